// Half and bfloat16 products (matrix products, convolutions) in float32, rounded once.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace supa {

// A product operator's supa kernel: the CPU kernel through the fallback (fallback.h), except where
// every tensor operand is half or every one bfloat16; those run on float32 copies of the operands
// through the host's float32 kernels, and the results (and written operands) are rounded back.
void run_product_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack);

}  // namespace supa
