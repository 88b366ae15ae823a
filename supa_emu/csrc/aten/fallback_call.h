// One call through the boxed fallback's machinery (fallback.cpp): the placement checks, host views
// of the supa operands, the kernel (or the shape rule), the results into card memory, the graph
// record and shapes mode's notes. call_routes.cpp decides which of these a call takes.
#pragma once

#include "fallback.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

namespace supa {

// `shape_rule`: the op's shape rule on meta operands instead of its kernel; `probe` (with it):
// only the rule runs, which raises where it cannot tell the results, and nothing is allocated
// (the stack is left as the rule left it).
void run_fallback_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel,
                       bool shape_rule = false, bool probe = false);

}  // namespace supa
