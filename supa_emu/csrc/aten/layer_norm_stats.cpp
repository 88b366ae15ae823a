// layer_norm's saved statistics in the card's precision. For half and bfloat16 inputs with
// parameters of the same type, PyTorch's CPU kernel keeps the mean and reciprocal standard
// deviation it saves for backward in the input's type, while a GPU's kernel (and the operator's
// shape rule, which the planner's shapes mode allocates from) keeps them in float32. The card
// holds what the GPU holds: forward hands back float32 copies of the CPU kernel's statistics (its
// own copies are scratch, which never reach the card's figures), and backward gives the CPU
// kernel the statistics back in the type it computes with.
#include "../runtime/devices.h"
#include "fallback.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

namespace supa {
namespace {

// native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
void layer_norm_forward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  op.redispatchBoxed(kCpuKeys, stack);
  const size_t first = stack->size() - 3;
  const at::ScalarType card_type = at::toOpMathType((*stack)[first].toTensor().scalar_type());
  for (size_t i = first + 1; i < stack->size(); ++i) {
    const at::Tensor stat = (*stack)[i].toTensor();
    if (stat.scalar_type() != card_type) {
      (*stack)[i] = stat.to(card_type);
    }
  }
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask)
void layer_norm_backward(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t first = stack->size() - 8;
  const at::Tensor input = (*stack)[first + 1].toTensor();
  const at::Tensor weight = optional_tensor((*stack)[first + 5]);
  // The CPU kernel keeps float statistics only for reduced-precision inputs with float parameters.
  const bool mixed = weight.defined() && weight.scalar_type() == at::kFloat;
  if (at::isReducedFloatingType(input.scalar_type()) && !mixed) {
    for (size_t i : {first + 3, first + 4}) {
      (*stack)[i] = (*stack)[i].toTensor().to(input.scalar_type());
    }
  }
  op.redispatchBoxed(kCpuKeys, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("native_layer_norm", torch::CppFunction::makeFromBoxedFunction<&host_kernel_call<&layer_norm_forward>>());
  m.impl("native_layer_norm_backward", torch::CppFunction::makeFromBoxedFunction<&host_kernel_call<&layer_norm_backward>>());
}

}  // namespace supa
