// F.scaled_dot_product_attention on supa: the operators a card's SDPA calls for the card's choice.
//
// PyTorch's composite calls aten::_scaled_dot_product_flash_attention for CUDA tensors only, and
// aten::_scaled_dot_product_flash_attention_for_cpu on any other device. Whatever names the
// attention operator expects the card's: selective activation checkpointing policies (torchtitan
// saves attention by op name), profilers, compiled graphs' pattern matchers. This kernel takes
// supa's calls at the autograd key, so that autograd records the flash operator and its backward,
// and at the backend key (inference mode): for flash it does what the composite does on CUDA; every
// other choice goes to the composite, which calls the card's operators for them already.
#include "sdp_choice.h"

#include "../runtime/devices.h"

#include <ATen/ATen.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace supa::sdpa_call {

// The checks the composite makes before it chooses: inputs that fail them go to it, which raises.
bool composite_accepts(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_mask) {
  const bool operands = query.dtype() == key.dtype() && query.dtype() == value.dtype() &&
                        query.device() == key.device() && query.device() == value.device() && query.dim() >= 2 &&
                        key.dim() >= 2 && value.dim() >= 2;
  if (!operands || !attn_mask.has_value()) {
    return operands;
  }
  const auto mask_dtype = attn_mask->scalar_type();
  return (mask_dtype == at::kBool || mask_dtype == at::kFloat || mask_dtype == query.scalar_type()) &&
         !query.is_nested() && !key.is_nested();
}

// As on CUDA: the flash kernel takes head sizes in multiples of 8, so others are padded with zeros
// for the call (autograd keeps the padded operands) and the output is sliced back.
at::Tensor pad_head_size(const at::Tensor& t) {
  const c10::SymInt size = t.sym_size(-1);
  if (size % 8 == 0) {
    return t;
  }
  return at::pad_symint(t, {c10::SymInt(0), 8 - size % 8});
}

at::Tensor flash(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double dropout_p,
                 bool is_causal, std::optional<double> scale) {
  const c10::SymInt head_size = query.sym_size(-1);
  // The scale of the unpadded head size.
  const double softmax_scale = sdp::calculate_scale(query, scale).guard_float(__FILE__, __LINE__);
  at::Tensor out = std::get<0>(at::_scaled_dot_product_flash_attention(
      pad_head_size(query), pad_head_size(key), pad_head_size(value), dropout_p, is_causal,
      /*return_debug_mask=*/false, softmax_scale));
  return out.sym_size(-1) == head_size ? out : out.slice_symint(-1, 0, head_size);
}

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                                        std::optional<double> scale, bool enable_gqa) {
  if (query.device().type() == kSupa && composite_accepts(query, key, value, attn_mask) &&
      select_sdp_backend(sdp::sdp_params{query, key, value, attn_mask, dropout_p, is_causal, enable_gqa}) ==
          at::SDPBackend::flash_attention) {
    return flash(query, key, value, dropout_p, is_causal, scale);
  }
  return at::native::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                  enable_gqa);
}

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(scaled_dot_product_attention));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("scaled_dot_product_attention", TORCH_FN(scaled_dot_product_attention));
}

}  // namespace supa::sdpa_call
