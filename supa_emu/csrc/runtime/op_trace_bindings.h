// Python bindings of the operator stream (op_trace.h): compiled with the other bindings.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

namespace supa {

void bind_op_trace(pybind11::module& m);

// (inputs, outputs) of a launch's encoded arguments (TraceEntry::args), as the planner reads them.
pybind11::tuple decode_trace_args(const std::vector<int64_t>& args);

}  // namespace supa
