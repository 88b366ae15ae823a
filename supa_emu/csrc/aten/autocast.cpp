// torch.autocast('supa'): the casting policies CUDA's autocast registers, taken from PyTorch's
// shared op lists, the ops it bans, and a fallthrough for every other operator.
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>

namespace {

using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;  // the names the shared op lists use unqualified

// Banned as on CUDA: binary_cross_entropy in float16 loses what a preceding sigmoid produced.
Tensor binary_cross_entropy_banned(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define SUPA_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define SUPA_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define SUPA_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define SUPA_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(SUPA_LOWER_PRECISION)
  AT_FORALL_FP32(SUPA_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(SUPA_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(SUPA_PROMOTE)
#undef SUPA_LOWER_PRECISION
#undef SUPA_FP32
#undef SUPA_FP32_SET_OPT_DTYPE
#undef SUPA_PROMOTE
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN((&binary_cross_entropy_banned)));
}

}  // namespace
