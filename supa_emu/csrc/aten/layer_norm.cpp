// Layer norm on supa keeps its statistics as a card's kernel does. For bfloat16 and float16 inputs
// PyTorch's CUDA kernel computes and saves the per-row mean and reciprocal standard deviation in
// float32 (the accumulate type), where the CPU kernel saves them in the input's dtype unless the
// weight is float32. The saved statistics live from forward to backward, so with the CPU's choice
// every bf16 layer norm of a model held half the card's bytes for them until its backward ran
// (49 layer norms of GPT-2 medium at 2 x 1024 tokens: 392 KiB of the step's peak).
//
// Here both directions run the CPU kernel's mixed-precision path (float32 weight and bias, cast on
// the host): it saves float32 statistics, and its output and input gradient are in the input's dtype.
// The card holds what CUDA's kernels allocate: forward the output, mean and rstd; backward the input,
// weight and bias gradients (the weight and bias gradients in the weight's dtype). The casts and the
// float32 weight gradients are host scratch. Other dtypes, and calls whose weight is float32 already,
// take the CPU kernel through the fallback unchanged. In shapes mode the shape rule gives the same
// results (float32 statistics) without running a kernel.
#include "fallback.h"


#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace supa {
namespace {

using at::Tensor;

bool keeps_float_statistics(const Tensor& input, const Tensor& weight) {
  return at::isReducedFloatingType(input.scalar_type()) &&
         (!weight.defined() || weight.scalar_type() == input.scalar_type());
}

// The weight and bias in float32 on the host (ones and zeros where the caller gave none, which
// leaves the values unchanged), so that the CPU kernel takes its mixed-precision path.
std::tuple<Tensor, Tensor> float_layer_norm_affine(const Tensor& weight, const Tensor& bias, int64_t normalized_numel) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  Tensor w = weight.defined() ? weight.to(at::kFloat) : at::ones({normalized_numel}, options);
  Tensor b = bias.defined() ? bias.to(at::kFloat) : at::zeros({normalized_numel}, options);
  return {std::move(w), std::move(b)};
}

int64_t normalized_numel_of(c10::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    n *= d;
  }
  return n;
}

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
void layer_norm_forward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 5);
  const Tensor input = args[0].toTensor();
  const std::vector<int64_t> shape = args[1].toIntVector();
  const Tensor weight = optional_tensor(args[2]);
  const Tensor bias = optional_tensor(args[3]);
  const double eps = args[4].toDouble();
  if (!keeps_float_statistics(input, weight)) {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    return;
  }
  const auto [w, b] = float_layer_norm_affine(weight, bias, normalized_numel_of(shape));
  auto [out, mean, rstd] = at::native_layer_norm(input, shape, w.reshape(shape), b.reshape(shape), eps);
  push_results(stack, 5, {out, mean, rstd});
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask)
//   -> (grad_input, grad_weight, grad_bias)
void layer_norm_backward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 8);
  const Tensor grad_out = args[0].toTensor();
  const Tensor input = args[1].toTensor();
  const std::vector<int64_t> shape = args[2].toIntVector();
  const Tensor mean = args[3].toTensor();
  const Tensor rstd = args[4].toTensor();
  const Tensor weight = optional_tensor(args[5]);
  const Tensor bias = optional_tensor(args[6]);
  const std::vector<bool> mask = args[7].to<std::vector<bool>>();
  if (!keeps_float_statistics(input, weight) || mean.scalar_type() != at::kFloat) {
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
    return;
  }
  Tensor grad_input, grad_weight, grad_bias;
  {
    // The fallback counts only the results on the card, in order (grad_input, grad_weight, grad_bias),
    // as CUDA's kernel allocates them.
    const auto [w, b] = float_layer_norm_affine(weight, bias, normalized_numel_of(shape));
    std::tie(grad_input, grad_weight, grad_bias) = at::native_layer_norm_backward(
        grad_out, input, shape, mean, rstd, w.reshape(shape), b.reshape(shape), {mask[0], mask[1], mask[2]});
    const c10::ScalarType param_type = weight.defined() ? weight.scalar_type() : input.scalar_type();
    if (grad_weight.defined()) {
      grad_weight = grad_weight.to(param_type);
    }
    if (grad_bias.defined()) {
      grad_bias = grad_bias.to(bias.defined() ? bias.scalar_type() : param_type);
    }
  }
  push_results(stack, 8, {grad_input, grad_weight, grad_bias});
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_layer_norm", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&layer_norm_forward>>());
  m.impl("native_layer_norm_backward", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&layer_norm_backward>>());
}

}  // namespace supa
