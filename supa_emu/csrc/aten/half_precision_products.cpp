// Half and bfloat16 products accumulate in float32 and round once, as a card's BLAS and
// convolution libraries do and as PyTorch's CPU kernels define them. Each call takes the faster of
// two host paths that keep that arithmetic:
// - the CPU's own kernel, where oneDNN runs it on matrix instructions for the type: oneDNN's
//   default ("strict") accumulation mode keeps float32 accumulators and rounds only the result,
//   and the instructions make it fast: bfloat16 dot products into float32 (AVX512_BF16's
//   VDPBF16PS, AMX_BF16), float16 ones (AVX512_FP16, AMX_FP16).
//   Chosen per type once at activation from the CPU's flags, for matrix-matrix products and
//   convolutions only, and only while oneDNN is on (torch.backends.mkldnn.enabled): PyTorch's
//   kernels without it round partial sums (measured: a bfloat16 convolution's input gradient).
// - float32 copies through the host's float32 kernels, rounded once: everywhere else. On an AVX2
//   host the CPU's bfloat16 kernels were 20-110x slower than this; on an AVX512_BF16 host its
//   bfloat16 dot product was 9x slower, so vector products (addmv, dot, vdot) stay here too, as do
//   _addmm_activation (the CPU kernel applies the GELU after rounding, a card's epilogue before)
//   and transposed convolutions whose output padding reaches the stride (PyTorch then skips oneDNN).
// The two paths differ only in the order of the float32 sums (docs/device_model.md#operators).
#include "half_precision_products.h"

#include "../runtime/devices.h"
#include "fallback.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cpu/Utils.h>

#include <atomic>
#include <utility>

namespace supa {
namespace {

// Whether each type's matrix products and convolutions take the CPU's kernel (choose_half_precision_kernels).
std::atomic<bool> g_bfloat16_on_host{false};
std::atomic<bool> g_float16_on_host{false};

// The type the call multiplies in when every tensor operand is half or every one bfloat16 and the
// results are of that type, else Undefined: overloads that name an output dtype keep their CPU
// kernel, and so does addbmm, which rounds after each batch's product on a card too (PyTorch adds
// them one by one with addmm_ for CUDA as for the CPU).
c10::ScalarType half_precision_type(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  constexpr c10::ScalarType kNone = c10::ScalarType::Undefined;
  if (op.schema().name() == "aten::addbmm" || op.schema().name() == "aten::addbmm_") {
    return kNone;
  }
  const auto& arguments = op.schema().arguments();
  auto args = torch::jit::last(stack, arguments.size());
  c10::ScalarType type = c10::ScalarType::Undefined;
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].type()->kind() == c10::TypeKind::ScalarTypeType) {
      return kNone;
    }
    if (!args[i].isTensor() || !args[i].toTensor().defined()) {
      continue;
    }
    const c10::ScalarType operand = args[i].toTensor().scalar_type();
    if ((operand != c10::kHalf && operand != c10::kBFloat16) || (type != kNone && operand != type)) {
      return kNone;
    }
    type = operand;
  }
  return type;
}

// Whether PyTorch's CPU kernel runs the call on oneDNN when it is on: matrix-matrix products and
// convolutions, except transposed ones with an output padding as large as the stride.
bool onednn_runs(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const std::string& name = op.schema().name();
  if (name == "aten::mm" || name == "aten::addmm" || name == "aten::addmm_" || name == "aten::bmm" ||
      name == "aten::baddbmm" || name == "aten::baddbmm_") {
    return true;
  }
  if (name != "aten::convolution" && name != "aten::convolution_backward" && name != "aten::_convolution") {
    return false;
  }
  const auto& schema = op.schema();
  auto args = torch::jit::last(stack, schema.arguments().size());
  if (!args[*schema.argumentIndexWithName("transposed")].toBool()) {
    return true;
  }
  const c10::IValue& strides = args[*schema.argumentIndexWithName("stride")];
  const c10::IValue& paddings = args[*schema.argumentIndexWithName("output_padding")];
  if (!strides.isIntList() || !paddings.isIntList()) {
    return false;  // symbolic sizes: not a call to judge, take float32 copies
  }
  const auto stride = strides.toDimVector();
  const auto padding = paddings.toDimVector();
  for (size_t i = 0; i < padding.size() && i < stride.size(); ++i) {
    if (padding[i] >= stride[i]) {
      return false;
    }
  }
  return true;
}

bool takes_host_kernel(c10::ScalarType type, const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const bool chosen = type == c10::kBFloat16 ? g_bfloat16_on_host.load(std::memory_order_relaxed)
                                             : g_float16_on_host.load(std::memory_order_relaxed);
  return chosen && at::globalContext().userEnabledMkldnn() && onednn_runs(op, stack);
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
  const c10::ScalarType type = half_precision_type(op, *stack);
  if (type != c10::ScalarType::Undefined && !takes_host_kernel(type, op, *stack)) {
    run_host_kernel(op, stack, &multiply_in_float32);
  } else {
    run_cpu_kernel(op, stack);
  }
}

std::vector<std::string> choose_half_precision_kernels(const std::unordered_set<std::string>& cpu_flags) {
  const auto has = [&](const char* flag) { return cpu_flags.count(flag) > 0; };
  const bool bfloat16 = at::hasMKLDNN() && (has("avx512_bf16") || has("amx_bf16"));
  const bool float16 = at::hasMKLDNN() && (has("avx512_fp16") || has("amx_fp16"));
  g_bfloat16_on_host.store(bfloat16);
  g_float16_on_host.store(float16);
  std::vector<std::string> chosen;
  if (bfloat16) {
    chosen.emplace_back("bfloat16");
  }
  if (float16) {
    chosen.emplace_back("float16");
  }
  return chosen;
}

std::unordered_set<std::string> host_cpu_flags() {
  std::unordered_set<std::string> flags;
  for (const auto& [name, value] : at::cpu::get_cpu_capabilities()) {
    if (value.isBool() && value.toBool()) {
      flags.insert(name);
    }
  }
  return flags;
}

}  // namespace supa
