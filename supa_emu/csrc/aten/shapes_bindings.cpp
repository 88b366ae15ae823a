// Python's access to shapes mode (shapes_bindings.h).
#include "shapes_bindings.h"

#include "shape_only.h"

#include <algorithm>
#include <vector>

namespace supa {

void bind_shapes_mode(pybind11::module& m) {
  namespace py = pybind11;
  m.def("_shapes_generated_kernel_runs", &generated_kernel_runs, py::arg("operands"), py::arg("written"),
        "shapes mode: whether a kernel torch.compile generated runs (shape_only.h)");
  m.def("_shapes_note_skipped_check", &note_skipped_check, py::arg("what"));
  m.def(
      "_shapes_values_unknown",
      [](const std::vector<at::Tensor>& tensors) {
        return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return values_unknown(t); });
      },
      py::arg("tensors"), "shapes mode: whether any of the tensors holds values the plan did not compute");
  m.def(
      "_shapes_note_values",
      [](const std::vector<at::Tensor>& tensors, bool unknown) {
        for (const at::Tensor& t : tensors) {
          note_values(t, unknown);
        }
      },
      py::arg("tensors"), py::arg("unknown"), "shapes mode: whether the tensors hold values the plan computed");
}

}  // namespace supa
