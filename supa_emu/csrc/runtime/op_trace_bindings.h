// Python bindings of the operator stream (op_trace.h): compiled with the other bindings.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace supa {

void bind_op_trace(pybind11::module& m);

}  // namespace supa
