// Python's access to shapes mode's value tracking and notes (shape_only.h), for the kernels torch.compile
// generates (supa_emu/compile/generated_kernels.py) and the emulator's own fused kernels written in
// Python (supa_emu/compile/flex_kernels.py).
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace supa {

void bind_shapes_mode(pybind11::module& m);

}  // namespace supa
