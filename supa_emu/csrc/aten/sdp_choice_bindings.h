// Python bindings of the card's attention choice (sdp_choice.h): compiled with the other bindings.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace supa {

// torch._C's _is_flash_attention_available and _can_use_{flash,mem_efficient,cudnn}_attention for supa.
void bind_sdp_choice(pybind11::module& m);

}  // namespace supa
