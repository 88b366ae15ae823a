// The profiler's card track: torch.profiler's device activity (PrivateUse1, or CUDA under the
// transfer) shows each supa launch for the time the card profile's model gives it
// (supa_emu/card_time.py), as a Kineto child profiler; the profiler without Kineto gets event stubs
// answering each operator's modelled device time. Compiled as a unit of its own: it parses
// Kineto's headers and pybind11.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace supa {

void bind_card_time_profiler(pybind11::module& m);

}  // namespace supa
