#include "op_trace_bindings.h"

#include "op_trace.h"

#include <c10/core/ScalarType.h>

#include <cstring>

namespace supa {
namespace {

// One argument from `tokens` at `at`: a tensor is (dtype name, device type, sizes tuple), an int
// list a list of ints, a tensor list a list of tensors, a device its type name.
py::object decode_trace_arg(const std::vector<int64_t>& tokens, size_t& at) {
  const int64_t tag = tokens[at++];
  switch (tag) {
    case kTensor: {
      const auto dtype = static_cast<c10::ScalarType>(tokens[at++]);
      const int64_t device = tokens[at++];
      const int64_t ndim = tokens[at++];
      py::tuple sizes(ndim);
      for (int64_t i = 0; i < ndim; ++i) {
        sizes[i] = py::int_(tokens[at++]);
      }
      return py::make_tuple(c10::toString(dtype), device, sizes);
    }
    case kInt:
      return py::int_(tokens[at++]);
    case kDouble: {
      double d = 0;
      std::memcpy(&d, &tokens[at++], sizeof d);
      return py::float_(d);
    }
    case kBool:
      return py::bool_(tokens[at++] != 0);
    case kIntList: {
      const int64_t n = tokens[at++];
      py::list list;
      for (int64_t i = 0; i < n; ++i) {
        list.append(py::int_(tokens[at++]));
      }
      return list;
    }
    case kList: {
      const int64_t n = tokens[at++];
      py::list list;
      for (int64_t i = 0; i < n; ++i) {
        list.append(decode_trace_arg(tokens, at));
      }
      return list;
    }
    case kDevice:
      return py::str(tokens[at++] == 1 ? "supa" : "cpu");
    default:
      return py::none();
  }
}

py::list take_trace() {
  py::list taken;
  for (const auto& e : op_trace_take()) {
    const py::tuple args = decode_trace_args(e.args);
    taken.append(py::make_tuple(static_cast<int64_t>(e.kind), e.name, static_cast<int64_t>(e.device),
                                static_cast<int64_t>(e.stream), e.aux, args[0], args[1]));
  }
  return taken;
}

}  // namespace

py::tuple decode_trace_args(const std::vector<int64_t>& args) {
  py::list inputs, outputs;
  size_t at = 0;
  py::list* into = &inputs;
  while (at < args.size()) {
    if (args[at] == kOutputs) {
      ++at;
      into = &outputs;
      continue;
    }
    into->append(decode_trace_arg(args, at));
  }
  return py::make_tuple(inputs, outputs);
}

void bind_op_trace(py::module& m) {
  m.def("_op_trace_enable", &op_trace_set_enabled, py::arg("on"),
        "Record every operator launched on the card, and the streams' events (the planner's time model)");
  m.def("_op_trace_pause", &op_trace_pause, py::arg("paused"), "Counted, per thread: record nothing dispatched here");
  m.def("_op_trace_mark", &op_trace_mark, py::arg("value"), "A mark on the current stream, in dispatch order");
  m.def("_op_trace_take", &take_trace,
        "[(kind, name index, device, stream, aux, inputs, outputs)] recorded since the last take");
  m.def("_op_trace_names", &op_trace_names);
}

}  // namespace supa
