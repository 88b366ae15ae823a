// Attention on host tensors in blocks of query rows, for what PyTorch's CPU flash kernel does not
// take (dropout, a value head size unlike the query's, the gradient of an additive mask): the
// math of scaled_dot_product_attention, never more than one block of scores at a time.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace supa::host_attention {

struct Call {
  at::Tensor query;  // (B, H, L, E)
  at::Tensor key;    // (B, Hk, S, E), Hk dividing H
  at::Tensor value;  // (B, Hk, S, Ev)
  at::Tensor bias;   // additive, broadcastable to (B, H, L, S); undefined: none
  bool is_causal;    // top-left aligned, as PyTorch's math
  double scale;
  double dropout_p;
  // The dropout mask is a function of these two numbers (and the shapes): backward draws it again.
  uint64_t seed;
  uint64_t offset;
};

// (output (B, H, L, Ev) in the inputs' dtype, log-sum-exp (B, H, L) float32).
std::tuple<at::Tensor, at::Tensor> forward(const Call& call);

// (grad query, grad key, grad value, grad bias as (B, H, L, S) float32 when `bias_grad`).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(const Call& call, const at::Tensor& grad_out,
                                                                    const at::Tensor& out, const at::Tensor& lse,
                                                                    bool bias_grad);

}  // namespace supa::host_attention
