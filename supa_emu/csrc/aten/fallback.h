// The boxed operator fallback: CPU kernels run on host views of supa operands.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstddef>
#include <initializer_list>

namespace supa {

void route_composite_ops_to_cpu_kernels();
// The boxed fallback: runs the op's CPU kernel on CPU views of its supa operands (zero
// copy) and hands the results back as supa tensors, counted on the card in the order the op
// returns them (the kernel's own scratch is not the card's). Usable as any op's supa kernel.
// In shapes mode the op's shape rule gives the results instead (shape_only.h).
void run_cpu_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same call machinery (placement checks, host views, results into device memory), but
// `kernel` runs on the host operands instead of the op's CPU kernel: for ops that have no
// CPU kernel because PyTorch only calls them for GPUs. In shapes mode, the op's shape rule.
using HostKernel = void (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);
void run_host_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel);
// `kernel` as an op's boxed supa kernel (registered with makeFromBoxedFunction).
template <HostKernel kernel>
void on_host_views(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_host_kernel(op, stack, kernel);
}
// For a kernel that allocates what the card holds itself (on supa, not through the host
// allocator) and computes into it through host views: it runs in shapes mode too, and computes
// only where shapes_mode() is off.
void run_card_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel);
// For host kernels: an optional tensor argument (undefined when None), and the step that
// replaces the `num_args` arguments on the stack with the kernel's results.
inline at::Tensor optional_tensor(const c10::IValue& value) {
  return value.isNone() ? at::Tensor() : value.toTensor();
}
inline void push_results(torch::jit::Stack* stack, size_t num_args, std::initializer_list<at::Tensor> results) {
  torch::jit::drop(*stack, num_args);
  for (const at::Tensor& t : results) {
    stack->emplace_back(t);
  }
}

}  // namespace supa
