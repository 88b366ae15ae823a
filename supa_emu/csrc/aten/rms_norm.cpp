// RMS norm on supa runs as a card's fused operators: aten::_fused_rms_norm and
// aten::_fused_rms_norm_backward. F.rms_norm calls _fused_rms_norm on every device; on a GPU it has
// a kernel and an autograd formula, while on the CPU (and on supa without this file) it decomposes
// into a dozen operators (to float32, pow, mean, rsqrt, mul...) whose autograd saves float32 copies
// of the input: a bfloat16 RMSNorm then held 4x its input's bytes from forward to backward where a
// card holds only float32 rstd per row, and profiles and selective-checkpointing policies saw the
// decomposition instead of the card's operator.
//
// Here the card's operators run, with the CPU's values. Forward runs the CPU's decomposition on the
// host (its float32 intermediates are host scratch) and returns what a GPU's kernel allocates: the
// output in the input's dtype and rstd in float32 (the accumulate type), shaped like the input with
// the normalized dimensions 1. Backward has no CPU kernel (the CPU never calls it), so it computes
// the gradients autograd computes through the CPU's decomposition: the same operations in the same
// order, so the values are the CPU's bit for bit; it allocates the input and weight gradients, as a
// GPU's kernel does. In shapes mode the shape rules give the same results without computing.
#include "fallback.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace supa {
namespace {

using at::Tensor;

// _fused_rms_norm(input, normalized_shape, weight?, eps?) -> (output, rstd)
void rms_norm_forward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 4);
  const Tensor input = args[0].toTensor();
  const std::vector<int64_t> shape = args[1].toIntVector();
  const std::optional<Tensor> weight = args[2].toOptional<Tensor>();
  const std::optional<double> eps = args[3].toOptional<double>();
  const at::DisableRecordFunctionGuard card_operator_only;  // profiles show the card's operator
  // On host tensors this is the CPU's decomposition.
  auto [out, rstd] = at::_fused_rms_norm(input, shape, weight, eps);
  push_results(stack, 4, {out, rstd});
}

// _fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight?, output_mask)
//   -> (grad_input, grad_weight)
// The decomposition is y = (x * r) * w in the accumulate type, r = rsqrt(mean(x^2) + eps), cast back
// to x's dtype; each line below is one step of autograd's walk back through it, written as
// PyTorch's derivative formulas write it (their operations decide the rounding), with gradients of
// broadcast operands reduced (sum_to) before they are cast, as the autograd engine does.
void rms_norm_backward(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 6);
  const Tensor grad_out = args[0].toTensor();
  const Tensor input = args[1].toTensor();
  const std::vector<int64_t> shape = args[2].toIntVector();
  const Tensor rstd = args[3].toTensor();
  const Tensor weight = optional_tensor(args[4]);
  const std::vector<bool> mask = args[5].to<std::vector<bool>>();
  const at::DisableRecordFunctionGuard card_operator_only;
  const c10::ScalarType opmath = at::toOpMathType(input.scalar_type());
  const Tensor x = input.to(opmath);
  const Tensor grad_y = grad_out.to(opmath);  // the cast back to x's dtype
  const Tensor normalized = x.mul(rstd);

  Tensor grad_weight;
  if (weight.defined() && mask[1]) {
    grad_weight = at::sum_to(grad_y * normalized, weight.sizes()).to(weight.scalar_type());
  }
  Tensor grad_input;
  if (mask[0]) {
    const Tensor grad_normalized = weight.defined() ? grad_y * weight : grad_y;
    const Tensor grad_x_direct = grad_normalized * rstd;
    const Tensor grad_rstd = at::sum_to(grad_normalized * x, rstd.sizes());
    const Tensor grad_mean_square = -0.5 * grad_rstd * rstd.pow(3);  // rsqrt's; the + eps passes it on
    int64_t normalized_numel = 1;
    for (int64_t d : shape) {
      normalized_numel *= d;
    }
    const Tensor grad_square = grad_mean_square.expand(x.sizes()) / c10::Scalar(normalized_numel);
    const double exponent = 2.0;
    const Tensor grad_x_square = grad_square * (exponent * x.pow(exponent - 1));
    grad_input = (grad_x_direct + grad_x_square).to(input.scalar_type());
  }
  push_results(stack, 6, {grad_input, grad_weight});
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_fused_rms_norm", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&rms_norm_forward>>());
  m.impl("_fused_rms_norm_backward", torch::CppFunction::makeFromBoxedFunction<&on_host_views<&rms_norm_backward>>());
}

}  // namespace supa
