#include "sdp_choice_bindings.h"

#include "sdp_choice.h"

#include <torch/csrc/Exceptions.h>

namespace supa {
namespace {

// torch.backends.cuda.SDPAParams (torch._C._SDPAParams) as the card's choice reads it.
sdp::sdp_params sdpa_params(py::handle params) {
  py::object mask = params.attr("attn_mask");
  return sdp::sdp_params{params.attr("query").cast<at::Tensor>(),
                         params.attr("key").cast<at::Tensor>(),
                         params.attr("value").cast<at::Tensor>(),
                         mask.is_none() ? std::nullopt : std::optional<at::Tensor>(mask.cast<at::Tensor>()),
                         params.attr("dropout").cast<double>(),
                         params.attr("is_causal").cast<bool>(),
                         params.attr("enable_gqa").cast<bool>()};
}

// torch._C._can_use_*_attention(params, debug) for supa inputs; `debug` warnings reach Python.
template <bool (*can_use)(const sdp::sdp_params&, bool)>
bool can_use_attention(py::handle params, bool debug) {
  const sdp::sdp_params parsed = sdpa_params(params);
  bool result = false;
  {
    torch::PyWarningHandler warnings;
    result = can_use(parsed, debug);
  }
  return result;
}

}  // namespace

void bind_sdp_choice(py::module& m) {
  m.def("_is_flash_attention_available", [] { return true; });
  m.def("_can_use_flash_attention", &can_use_attention<&supa::can_use_flash_attention>, py::arg("params"),
        py::arg("debug") = false);
  m.def("_can_use_mem_efficient_attention", &can_use_attention<&supa::can_use_mem_efficient_attention>,
        py::arg("params"), py::arg("debug") = false);
  m.def("_can_use_cudnn_attention", &can_use_attention<&supa::can_use_cudnn_attention>, py::arg("params"),
        py::arg("debug") = false);
}

}  // namespace supa
