// Which way a supa operator call through the fallback goes: in the planner's shapes mode its shape
// rule (shape_only.h), while a graph captures the stream a recorded call (graph.h), otherwise its
// kernel; each way carried out by the fallback's call machinery (fallback_call.h).
#include "fallback.h"
#include "fallback_call.h"
#include "shape_only.h"

#include "../runtime/device_guard.h"
#include "../runtime/devices.h"
#include "../runtime/graph.h"
#include "../runtime/host_alias.h"
#include "../runtime/stream_timeline.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace supa {
namespace {

// Shapes mode: the call's shape rule where it tells the results; otherwise its kernel, noted.
void run_in_shapes_mode(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel) {
  const size_t num_args = op.schema().arguments().size();
  if (is_device_assert(op) && reads_unknown_values(op, *stack)) {
    // A check of values the plan did not compute: reported, not failed (compute mode checks them).
    note_kernel_ran(op, KernelReason::kValueDependent);
    torch::jit::drop(*stack, num_args);
    return;
  }
  const ShapesRoute route = shapes_route(op, *stack);
  if (route == ShapesRoute::kKernel) {
    if (op.hasTag(at::Tag::data_dependent_output) && reads_unknown_values(op, *stack)) {
      note_kernel_ran(op, KernelReason::kValueDependent);  // .item() of values the plan did not compute
    }
    run_fallback_call(op, stack, kernel);
    return;
  }
  const size_t base = stack->size() - num_args;
  std::vector<c10::IValue> arguments = with_own_lists(torch::jit::last(*stack, num_args));
  if (values_known_integral(op, *stack)) {
    // Integer and boolean results of known values are computed (shape_only.h): the rule tells
    // whether the results are such (a float result of integers, `positions.float()`, is not).
    bool integral = route == ShapesRoute::kShapeRuleElseKernel;  // sizes from the values: compute them
    if (!integral) {
      try {
        run_fallback_call(op, stack, kernel, /*shape_rule=*/true, /*probe=*/true);
        integral = std::all_of(stack->begin() + base, stack->end(), [](const c10::IValue& v) {
          return !v.isTensor() || at::isIntegralType(v.toTensor().scalar_type(), /*includeBool=*/true);
        });
      } catch (const std::exception&) {
        // The rule could not tell: the usual route below decides.
      }
      stack->resize(base);
      stack->insert(stack->end(), arguments.begin(), arguments.end());
    }
    if (integral) {
      run_fallback_call(op, stack, kernel);
      return;
    }
    arguments = with_own_lists(torch::jit::last(*stack, num_args));
  }
  std::optional<KernelReason> reason;
  bool without_meta_kernel = false;
  try {
    run_fallback_call(op, stack, kernel, /*shape_rule=*/true, /*probe=*/route == ShapesRoute::kKernelAfterRule);
    if (route != ShapesRoute::kKernelAfterRule) {
      return;
    }
  } catch (const c10::OutOfMemoryError&) {
    // The rule told the results and the card has no room for them: the kernel would only ask again.
    throw;
  } catch (const c10::NotImplementedError&) {
    // The dispatcher found no Meta kernel, or a dynamic-shape rule needs the values.
    without_meta_kernel = route == ShapesRoute::kShapeRule;
    reason = without_meta_kernel ? KernelReason::kNoShapeRule : KernelReason::kValueDependent;
  } catch (const std::exception&) {
    // A rule that raised (a Python meta function, a check): the kernel gives the real answer or error.
    reason = route == ShapesRoute::kShapeRule ? KernelReason::kNoShapeRule : KernelReason::kValueDependent;
  }
  stack->resize(base);
  stack->insert(stack->end(), arguments.begin(), arguments.end());
  if (without_meta_kernel) {
    note_kernel_ran(op, *reason);  // before the kernel runs: later calls go straight to it
  }
  // A result sized by values the plan computed (a known mask, known indices) is the real one.
  const bool noted = reason.has_value() && !without_meta_kernel &&
                     (reason != KernelReason::kValueDependent || sizes_from_unknown_values(op, *stack));
  run_fallback_call(op, stack, kernel);
  if (noted) {
    note_kernel_ran(op, *reason);
  }
}

bool has_sparse_operand(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  auto sparse = [](const c10::IValue& v) { return v.isTensor() && v.toTensor().layout() != c10::kStrided; };
  for (const c10::IValue& value : torch::jit::last(stack, op.schema().arguments().size())) {
    if (sparse(value) || (value.isList() && std::any_of(value.toListRef().begin(), value.toListRef().end(), sparse))) {
      return true;
    }
  }
  return false;
}

// The supa tensors a call writes (its `Tensor(a!)` arguments).
std::vector<at::Tensor> written_operands(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  std::vector<at::Tensor> written;
  const auto& arguments = op.schema().arguments();
  auto add = [&](const c10::IValue& v) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().device().type() == kSupa &&
        v.toTensor().layout() == c10::kStrided) {
      written.push_back(v.toTensor());
    }
  };
  const auto values = torch::jit::last(stack, arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].alias_info() == nullptr || !arguments[i].alias_info()->isWrite()) {
      continue;
    }
    add(values[i]);
    if (values[i].isList()) {
      for (const c10::IValue& item : values[i].toListRef()) {
        add(item);
      }
    }
  }
  return written;
}

// Graph capture: a call is recorded (graph.h) and its results are allocated from the graph's pool
// with the sizes its shape rule gives, as a card records a kernel launch: nothing is computed and
// no operand changes until replay. Random calls, sparse operands and ops without a shape rule run
// their kernel so that their results' sizes and the generators' counters are those of the call,
// and the operands they write are put back as they were.
void run_in_capture(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel) {
  if (op.hasTag(at::Tag::data_dependent_output)) {
    // .item(), equal(), is_nonzero(): the host would wait for the stream, which a capture forbids.
    refuse_during_capture(op.schema().operator_name().name);
  }
  const bool seeded = op.hasTag(at::Tag::nondeterministic_seeded);
  // mkldnn_rnn_layer's shape rule gives an empty workspace where its CPU kernel makes one: replay
  // would write the kernel's workspace into the rule's.
  const bool kernel_sized = op.schema().name() == "aten::mkldnn_rnn_layer";
  if (!seeded && !kernel_sized && !has_sparse_operand(op, *stack)) {
    const size_t num_args = op.schema().arguments().size();
    const size_t base = stack->size() - num_args;
    std::vector<c10::IValue> arguments = with_own_lists(torch::jit::last(*stack, num_args));
    try {
      run_fallback_call(op, stack, kernel, /*shape_rule=*/true);
      return;
    } catch (const c10::OutOfMemoryError&) {
      throw;  // the graph's pool has no room for the results the rule told
    } catch (const std::exception&) {
      if (op.hasTag(at::Tag::dynamic_output_shape)) {
        // nonzero, masked_select, boolean-mask indexing: the result's size needs the values.
        refuse_during_capture(op.schema().operator_name().name);
      }
      // No shape rule here (or the rule refused the call): the kernel tells, or raises the real error.
    }
    stack->resize(base);
    stack->insert(stack->end(), arguments.begin(), arguments.end());
  }
  std::vector<at::Tensor> written = written_operands(op, *stack);
  std::vector<at::Tensor> before;
  before.reserve(written.size());
  for (const at::Tensor& t : written) {
    before.push_back(host_view(t).clone());
  }
  run_fallback_call(op, stack, kernel);
  for (size_t i = 0; i < written.size(); ++i) {
    if (written[i].sizes() == before[i].sizes()) {  // a resized out= holds fresh memory: nothing to restore
      host_view(written[i]).copy_(before[i]);
    }
  }
}

void run_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel) {
  if (op.hasTag(at::Tag::data_dependent_output)) {
    // .item(), equal(), is_nonzero(): the host reads the result, so it waits for the stream first.
    const c10::DeviceIndex device = current_device();
    wait_until_ns(stream_ready_ns(device, current_stream_id(device)));
  }
  if (shapes_mode()) {
    run_in_shapes_mode(op, stack, kernel);
  } else if (is_capturing() && !is_replaying()) {
    run_in_capture(op, stack, kernel);
  } else {
    run_fallback_call(op, stack, kernel);
  }
}

}  // namespace

void run_cpu_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  run_call(op, stack, nullptr);
}

void run_host_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel) {
  run_call(op, stack, kernel);
}

void run_card_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel) {
  run_fallback_call(op, stack, kernel);
}

}  // namespace supa
