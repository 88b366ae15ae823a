// The operators a card runs in its BLAS library (matrix products, matrix-vector products, dot
// products, every overload): the CPU kernel computes, through the fallback, and then the call
// takes the card's BLAS workspace for its thread and stream (runtime/blas_workspace.h), as the
// library does when PyTorch hands it the call: after the result is allocated, only when there is
// a product to compute. matmul, linear, einsum and friends are composites that reach these.
// The card's library needs nothing beyond the workspace; the CPU kernel's packing and conversion
// buffers are its scratch, which the fallback keeps off the card's figures.
// Half and bfloat16 products take the host's float32 GEMM (half_precision_products.h).
#include "blas_ops.h"

#include "../runtime/blas_workspace.h"
#include "../runtime/devices.h"
#include "fallback.h"
#include "half_precision_products.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

namespace supa {
namespace {

constexpr const char* kBlasOps[] = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::_addmm_activation",
                                    "aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::addbmm",
                                    "aten::addbmm_", "aten::addmv", "aten::addmv_", "aten::dot", "aten::vdot"};

bool is_blas_op(const std::string& name) {
  for (const char* candidate : kBlasOps) {
    if (name == candidate) {
      return true;
    }
  }
  return false;
}

bool is_float_type(c10::ScalarType type) {
  return type == c10::kFloat || type == c10::kHalf || type == c10::kBFloat16 || type == c10::kDouble;
}

// What PyTorch's CUDA addmm checks before it takes the bias-epilogue (cuBLASLt) path: a
// functional addmm (or addmm.out into another tensor) with a contiguous bias vector over the
// columns, beta 1, floating point, and both matrices larger than one row and one column.
bool takes_bias_epilogue(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& name = op.schema().operator_name();
  if ((name.name != "aten::addmm" && name.name != "aten::_addmm_activation") ||
      (!name.overload_name.empty() && name.overload_name != "out")) {
    return false;
  }
  const size_t num_args = op.schema().arguments().size();
  auto args = torch::jit::last(stack, num_args);
  if (!args[0].isTensor() || !args[1].isTensor() || !args[2].isTensor() || !args[3].isScalar()) {
    return false;
  }
  const at::Tensor& bias = args[0].toTensor();
  const at::Tensor& mat1 = args[1].toTensor();
  const at::Tensor& mat2 = args[2].toTensor();
  if (name.overload_name == "out" && args[num_args - 1].isTensor() && args[num_args - 1].toTensor().is_same(bias)) {
    return false;
  }
  const c10::Scalar beta = args[3].toScalar();
  return !beta.isComplex() && beta.toDouble() == 1.0 && bias.dim() == 1 && mat1.dim() == 2 && mat2.dim() == 2 &&
         bias.size(0) == mat2.size(1) && bias.is_contiguous() && is_float_type(bias.scalar_type()) &&
         mat1.size(0) > 1 && mat1.size(1) > 1 && mat2.size(0) > 1 && mat2.size(1) > 1;
}

// The call's device and whether the library is reached at all (no product of empty operands is
// computed: PyTorch returns before taking the handle). Written operands (out=) do not count.
struct BlasCall {
  c10::DeviceIndex device = -1;
  bool computes = true;
};

BlasCall inspect(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  BlasCall call;
  const auto& arguments = op.schema().arguments();
  auto args = torch::jit::last(stack, arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (!args[i].isTensor()) {
      continue;
    }
    const at::Tensor& t = args[i].toTensor();
    if (!t.defined()) {
      continue;
    }
    if (call.device < 0 && t.device().type() == kSupa) {
      call.device = t.device().index();
    }
    const auto* alias = arguments[i].alias_info();
    const bool out = alias != nullptr && alias->isWrite() && arguments[i].kwarg_only();
    if (!out && t.numel() == 0) {
      call.computes = false;
    }
  }
  return call;
}

void run_blas_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const BlasCall call = inspect(op, *stack);
  const bool lt = call.computes && takes_bias_epilogue(op, *stack);
  run_product_kernel(op, stack);
  if (call.computes && call.device >= 0) {
    ensure_blas_workspace(call.device, lt);
  }
}

}  // namespace

void register_blas_ops() {
  static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (!is_blas_op(name.name)) {
      continue;
    }
    auto op = dispatcher.findOp(name);
    if (!op.has_value() || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    const std::string qualified = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    library.impl(qualified.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&run_blas_op>());
  }
}

}  // namespace supa
