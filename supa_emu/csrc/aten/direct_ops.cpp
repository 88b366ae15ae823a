// Unboxed supa kernels for the hottest in-place elementwise ops (add_, sub_, mul_, div_ with a
// tensor or a wrapped scalar, fill_, zero_). Optimizers and DeepSpeed's bucketing issue these by
// the thousand on small tensors, where the boxed fallback's cost (boxing the arguments, walking
// the schema, unboxing again for the CPU kernel) is comparable to the op itself.
//
// The fast path covers only the plain case: strided supa operands on one device, not capturing a
// graph; the second operand may also be a 0-dim CPU tensor (a Python number arrives as one).
// Anything else goes through the boxed fallback, which owns the placement errors, sparse
// layouts and graph recording, so behaviour is that of the fallback in every case. So does every
// call in the planner's shapes mode, where the fallback decides whether the kernel runs.
#include "../runtime/devices.h"
#include "../runtime/graph.h"
#include "../runtime/host_alias.h"
#include "../runtime/host_routing_allocator.h"
#include "fallback.h"
#include "shape_only.h"

#include <ATen/ops/add_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/fill_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/zero_ops.h>
#include <torch/library.h>

namespace supa {
namespace {

bool plain_supa(const at::Tensor& t) {
  return t.defined() && t.device().type() == kSupa && t.layout() == c10::kStrided;
}

// `other` may join `self` on the fast path: same supa device, or a 0-dim CPU scalar.
bool joins_fast_path(const at::Tensor& self, const at::Tensor& other) {
  if (!other.defined()) {
    return false;
  }
  if (other.device().type() == c10::DeviceType::CPU) {
    return other.dim() == 0 && other.layout() == c10::kStrided;
  }
  return plain_supa(other) && other.device().index() == self.device().index();
}

at::Tensor host_operand(const at::Tensor& t, const at::Tensor& self, const at::Tensor& self_host) {
  if (t.device().type() == c10::DeviceType::CPU) {
    return t;
  }
  if (t.storage().unsafeGetStorageImpl() == self.storage().unsafeGetStorageImpl()) {
    // Views of one storage share one host storage, so the kernel sees them as aliases.
    return tensor_over(self_host.storage(), kCpuKeys, t);
  }
  return host_view(t);
}

template <class Op>
const c10::OperatorHandle& handle() {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
  return op;
}

// The boxed fallback, called with the op's unboxed arguments.
template <class Op, class... Args>
void via_fallback(Args&&... args) {
  torch::jit::Stack stack;
  stack.reserve(sizeof...(Args));
  (stack.emplace_back(std::forward<Args>(args)), ...);
  run_cpu_kernel(handle<Op>(), &stack);
}

// Runs `cpu_call(self_host, ...)` with self and the optional second operand as host views.
template <class Call>
void on_host_views(const at::Tensor& self, const at::Tensor* other, Call&& cpu_call) {
  const c10::DeviceIndex device = self.device().index();
  at::Tensor self_host = host_view(self);
  CurrentDeviceScope guard(device);
  DeviceOutputScope route_outputs(device);  // temporaries the kernel makes come from the card
  if (other != nullptr) {
    cpu_call(self_host, host_operand(*other, self, self_host));
  } else {
    cpu_call(self_host, self_host);
  }
}

template <class Op>
at::Tensor& binary_alpha_(at::Tensor& self, const at::Tensor& other, const c10::Scalar& alpha) {
  if (!plain_supa(self) || !joins_fast_path(self, other) || is_capturing() || shapes_mode()) {
    via_fallback<Op>(self, other, alpha);
    return self;
  }
  on_host_views(self, &other, [&](at::Tensor& s, const at::Tensor& o) { Op::redispatch(kCpuKeys, s, o, alpha); });
  return self;
}

template <class Op>
at::Tensor& binary_(at::Tensor& self, const at::Tensor& other) {
  if (!plain_supa(self) || !joins_fast_path(self, other) || is_capturing() || shapes_mode()) {
    via_fallback<Op>(self, other);
    return self;
  }
  on_host_views(self, &other, [&](at::Tensor& s, const at::Tensor& o) { Op::redispatch(kCpuKeys, s, o); });
  return self;
}

at::Tensor& fill_scalar_(at::Tensor& self, const c10::Scalar& value) {
  using Op = at::_ops::fill__Scalar;
  if (!plain_supa(self) || is_capturing() || shapes_mode()) {
    via_fallback<Op>(self, value);
    return self;
  }
  on_host_views(self, nullptr, [&](at::Tensor& s, const at::Tensor&) { Op::redispatch(kCpuKeys, s, value); });
  return self;
}

at::Tensor& zero_(at::Tensor& self) {
  using Op = at::_ops::zero_;
  if (!plain_supa(self) || is_capturing() || shapes_mode()) {
    via_fallback<Op>(self);
    return self;
  }
  on_host_views(self, nullptr, [&](at::Tensor& s, const at::Tensor&) { Op::redispatch(kCpuKeys, s); });
  return self;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("add_.Tensor", binary_alpha_<at::_ops::add__Tensor>);
  m.impl("sub_.Tensor", binary_alpha_<at::_ops::sub__Tensor>);
  m.impl("mul_.Tensor", binary_<at::_ops::mul__Tensor>);
  m.impl("div_.Tensor", binary_<at::_ops::div__Tensor>);
  m.impl("fill_.Scalar", fill_scalar_);
  m.impl("zero_", zero_);
}

}  // namespace supa
