// torch.autocast('supa'): the same casting policies CUDA uses, taken from PyTorch's shared
// op lists, and a fallthrough for every other operator.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define SUPA_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define SUPA_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define SUPA_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(SUPA_LOWER_PRECISION)
  AT_FORALL_FP32(SUPA_FP32)
  AT_FORALL_PROMOTE(SUPA_PROMOTE)
#undef SUPA_LOWER_PRECISION
#undef SUPA_FP32
#undef SUPA_PROMOTE
}

}  // namespace
