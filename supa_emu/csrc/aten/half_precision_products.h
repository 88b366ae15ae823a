// Half and bfloat16 products (matrix products, convolutions): float32 accumulation, one rounding.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <string>
#include <unordered_set>
#include <vector>

namespace supa {

// A product operator's supa kernel: the CPU kernel through the fallback (fallback.h), except where
// every tensor operand is half or every one bfloat16 and the host's own kernel for that type and
// operator was not chosen (choose_half_precision_kernels); those run on float32 copies of the
// operands through the host's float32 kernels, and the results (and written operands) are rounded back.
void run_product_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

// Which types' matrix products and convolutions take the host's own kernels, from a CPU's
// capability flags (at::cpu::get_cpu_capabilities()'s names of the true ones): made at activation
// from this host's flags, and by tests from others. Returns the chosen types ("bfloat16", "float16").
std::vector<std::string> choose_half_precision_kernels(const std::unordered_set<std::string>& cpu_flags);
std::unordered_set<std::string> host_cpu_flags();

}  // namespace supa
