// Half and bfloat16 products accumulate in float32 and round once, as a card's BLAS and
// convolution libraries do and as PyTorch's CPU kernels define them, but here they run through the
// host's float32 kernels: the CPU's own half/bfloat16 kernels are fast only on hosts with bf16/fp16
// matrix instructions. On an AVX2 host a bfloat16 1024^3 matrix product took 3.9 s against 46 ms
// in float32, and a bfloat16 3x3 convolution 40x the float32 one (docs/device_model.md#operators).
// Only the order of the float32 sums differs from the CPU's half-precision kernels.
#include "half_precision_products.h"

#include "../runtime/devices.h"
#include "fallback.h"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace supa {
namespace {

// Whether the call multiplies half or bfloat16 operands only (every tensor of one of those types)
// into results of that type: overloads that name an output dtype keep their CPU kernel, and so
// does addbmm, which rounds after each batch's product on a card too (PyTorch adds them one by one
// with addmm_ for CUDA as for the CPU).
bool multiplies_in_half_precision(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (op.schema().name() == "aten::addbmm" || op.schema().name() == "aten::addbmm_") {
    return false;
  }
  const auto& arguments = op.schema().arguments();
  auto args = torch::jit::last(stack, arguments.size());
  c10::ScalarType type = c10::ScalarType::Undefined;
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].type()->kind() == c10::TypeKind::ScalarTypeType) {
      return false;
    }
    if (!args[i].isTensor() || !args[i].toTensor().defined()) {
      continue;
    }
    const c10::ScalarType operand = args[i].toTensor().scalar_type();
    if (operand != c10::kHalf && operand != c10::kBFloat16) {
      return false;
    }
    if (type != c10::ScalarType::Undefined && operand != type) {
      return false;
    }
    type = operand;
  }
  return type != c10::ScalarType::Undefined;
}

// A host kernel (fallback.h): the call on float32 copies of its operands, then its results and
// written operands rounded back to their type. Every return of these overloads is new (or absent:
// convolution_backward's unrequested gradients) or the one written operand.
void multiply_in_float32(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t first = stack->size() - num_args;
  c10::ScalarType type = c10::ScalarType::Undefined;
  std::vector<std::pair<at::Tensor, at::Tensor>> written;  // (operand, its float32 copy)
  for (size_t i = 0; i < num_args; ++i) {
    c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor() || !value.toTensor().defined()) {
      continue;
    }
    at::Tensor operand = value.toTensor();
    type = operand.scalar_type();
    at::Tensor wide = operand.to(at::kFloat);
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      written.emplace_back(operand, wide);
    }
    value = std::move(wide);
  }
  op.redispatchBoxed(kCpuKeys, stack);
  for (auto& [operand, wide] : written) {
    if (operand.sizes() != wide.sizes()) {
      operand.resize_(wide.sizes());  // out= of another shape: the kernel resized (and warned about) the copy
    }
    operand.copy_(wide);
  }
  const size_t first_return = stack->size() - schema.returns().size();
  for (size_t j = 0; j < schema.returns().size(); ++j) {
    c10::IValue& value = (*stack)[first_return + j];
    if (schema.returns()[j].alias_info() != nullptr) {
      TORCH_INTERNAL_ASSERT(written.size() == 1, "supa_emu: ", schema.operator_name(), " returns an unknown alias");
      value = written.front().first;
    } else if (value.isTensor() && value.toTensor().defined()) {
      value = value.toTensor().to(type);
    }
  }
}

}  // namespace

void run_product_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  if (multiplies_in_half_precision(op, *stack)) {
    run_host_kernel(op, stack, &multiply_in_float32);
  } else {
    run_cpu_kernel(op, stack);
  }
}

}  // namespace supa
