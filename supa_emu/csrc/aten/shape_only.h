// The planner's shapes mode: operators on supa tensors take their results' sizes, strides and
// dtypes from PyTorch's shape rules (the Meta dispatch key: C++ meta functions, Python meta
// registrations, composite kernels run on meta tensors) and allocate them on the card as their
// kernels' results would be (fallback.cpp), without running the kernels. What still runs its
// kernel, and why, is decided here; the operators whose outputs depend on values, and those
// without a shape rule, are noted with the first call site for the planner's report.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch {
struct CapturedTraceback;
}

namespace supa {

constexpr c10::DispatchKeySet kMetaKeys{c10::DispatchKey::Meta};

// Set once, when the devices are created.
void set_shapes_mode(bool on);
bool shapes_mode();

// How one call is carried out in shapes mode.
// Operators tagged dynamic_output_shape (nonzero, masked_select, index with a mask, ...) try their
// shape rule first: where it needs the values it fails, and the call is value-dependent.
enum class ShapesRoute {
  kKernel,               // its kernel runs: small operands, values read (.item()), sparse, no shape rule known
  kShapeRule,            // its results come from the shape rule
  kShapeRuleElseKernel,  // the shape rule; where it needs the values, the kernel (value-dependent)
  kKernelAfterRule,      // small operands: the kernel, after the shape rule told whether it is value-dependent
};
ShapesRoute shapes_route(const c10::OperatorHandle& op, const torch::jit::Stack& stack);

// Which supa tensors hold values in shapes mode. A tensor a shape rule made (or wrote) holds
// none, nor does one a kernel computed from such a tensor; every other one holds what compute mode
// would hold. Integer and boolean results of operands that hold values are computed whatever their
// size (positions, token ids, masks: they cost little, and checks and indexing read them), so
// `values_known_integral` calls take their kernel.
bool values_unknown(const at::Tensor& t);
void note_values(const at::Tensor& t, bool unknown);
// Whether any supa tensor operand of the call holds no values.
bool reads_unknown_values(const c10::OperatorHandle& op, const torch::jit::Stack& stack);
// Whether a result sized by values (nonzero, boolean-mask indexing) is sized by values the plan did
// not compute: an integer or boolean operand without values, or, where there is none, any operand.
bool sizes_from_unknown_values(const c10::OperatorHandle& op, const torch::jit::Stack& stack);
// Whether every supa tensor operand of the call is an integer or boolean tensor holding values.
bool values_known_integral(const c10::OperatorHandle& op, const torch::jit::Stack& stack);
// A device-side assertion (`_assert_async`): on values shapes mode did not compute it asserts
// nothing; it is reported and skipped.
bool is_device_assert(const c10::OperatorHandle& op);

// Why a call ran its kernel in shapes mode, for the report.
enum class KernelReason { kValueDependent, kNoShapeRule };
void note_kernel_ran(const c10::OperatorHandle& op, KernelReason reason);

// A kernel torch.compile generated for supa tensors (supa_emu/compile/generated_kernels.py): whether it
// runs in shapes mode, by the rules an operator in its place follows: its supa operands total at most
// 64 KiB, or every supa operand, the tensors it writes included, is an integer or boolean tensor that
// holds values. `operands` are all its tensor arguments, `written` those it writes.
bool generated_kernel_runs(const std::vector<at::Tensor>& operands, const std::vector<at::Tensor>& written);
// A device-side check compiled into a generated kernel that did not run: reported as value-dependent
// under `what`, with the first call site.
void note_skipped_check(const std::string& what);

struct ShapesNote {
  std::string kind;  // "value-dependent" | "no shape rule"
  std::string op;
  int64_t count;
  std::shared_ptr<torch::CapturedTraceback> first_site;
};
std::vector<ShapesNote> shapes_notes();

// Whether the host moves `nbytes` of card data from one place on the card to another (a copy
// between supa tensors, the bytes a grown storage keeps): always, except in shapes mode, where
// only small amounts are moved. Copies from and to the host always move their bytes.
bool card_bytes_move(uint64_t nbytes);

// A meta storage of `nbytes`: what a supa storage is to a shape rule (views of one supa storage
// share one, so the rule sees them alias).
c10::Storage meta_storage(size_t nbytes);
// The card tensor a shape rule's new result stands for: a fresh block of its storage's size on
// `device`, with its geometry. It reads as zeros (the kernel that would write it did not run).
at::Tensor card_result(const at::Tensor& meta, c10::DeviceIndex device);
// Gives a supa storage the size a shape rule gave its meta storage (out= and resize_ grow them):
// a fresh block, no bytes copied.
void resize_card_storage(c10::StorageImpl* storage, size_t nbytes, c10::DeviceIndex device);

}  // namespace supa
