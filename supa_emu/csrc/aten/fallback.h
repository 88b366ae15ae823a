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
// copy) and hands the results back as supa tensors. Usable as any op's supa kernel.
void run_cpu_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same, with the CPU kernel's scratch in host memory, not on the card: for operator families
// whose card kernels allocate nothing beyond their results (docs/card_memory.md, "Kernel scratch by
// operator family"). The kernel's first allocations (its results) still come from the card.
void run_cpu_kernel_with_host_scratch(const c10::OperatorHandle& op, torch::jit::Stack* stack);
// The same call machinery (placement checks, host views, results into device memory), but
// `kernel` runs on the host operands instead of the op's CPU kernel: for ops that have no
// CPU kernel because PyTorch only calls them for GPUs.
using HostKernel = void (*)(const c10::OperatorHandle& op, torch::jit::Stack* stack);
void run_host_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel);
// `kernel` as an op's boxed supa kernel (registered with makeFromBoxedFunction).
template <HostKernel kernel>
void on_host_views(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_host_kernel(op, stack, kernel);
}
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
