// Shapes mode (see shape_only.h): which calls take their shape rule, and the card memory that
// stands for a skipped kernel's results.
#include "shape_only.h"

#include "../runtime/caching_allocator.h"
#include "../runtime/devices.h"
#include "../runtime/host_alias.h"

#include <c10/core/Allocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <atomic>
#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace supa {
namespace {

std::atomic<bool> g_shapes_mode{false};

// Operands up to this many bytes in all run their kernel: the step counters, flags, norms and
// losses a training loop reads back then hold what the kernels make of the values present, which
// keeps the program on its path (a finite loss, no overflow) at no cost worth planning for.
constexpr uint64_t kSmallOperandBytes = 64 << 10;

struct ShapesNotes {
  std::mutex mutex;
  std::unordered_set<const c10::FunctionSchema*> without_rule;
  std::map<std::pair<std::string, std::string>, ShapesNote> notes;  // (kind, op) -> note
};

ShapesNotes& notes_state() {
  static auto* state = new ShapesNotes();  // never destroyed: ops may run while the process exits
  return *state;
}

bool known_without_rule(const c10::OperatorHandle& op) {
  ShapesNotes& s = notes_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.without_rule.count(&op.schema()) != 0;
}

// Adds a supa operand's logical bytes; false for a layout no shape rule here takes (sparse).
bool add_operand(const at::Tensor& t, uint64_t* bytes) {
  if (!t.defined() || t.device().type() != kSupa) {
    return true;
  }
  if (t.layout() != c10::kStrided) {
    return false;
  }
  *bytes += static_cast<uint64_t>(t.numel()) * t.dtype().itemsize();
  return true;
}

// The storages whose values are unknown, each held weakly: an entry whose storage died is stale.
struct UnknownValues {
  std::mutex mutex;
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  size_t sweep_at = 1024;
};

UnknownValues& unknown_values() {
  static auto* state = new UnknownValues();  // never destroyed: ops may run while the process exits
  return *state;
}

template <typename Fn>
void for_each_supa_operand(const c10::OperatorHandle& op, const torch::jit::Stack& stack, Fn fn) {
  for (const c10::IValue& value : torch::jit::last(stack, op.schema().arguments().size())) {
    if (value.isTensor()) {
      fn(value.toTensor());
    } else if (value.isList()) {
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor()) {
          fn(item.toTensor());
        }
      }
    }
  }
}

bool is_supa(const at::Tensor& t) {
  return t.defined() && t.device().type() == kSupa;
}

}  // namespace

bool values_unknown(const at::Tensor& t) {
  if (!is_supa(t) || !t.has_storage()) {
    return false;
  }
  UnknownValues& u = unknown_values();
  std::lock_guard<std::mutex> lock(u.mutex);
  auto it = u.storages.find(t.storage().unsafeGetStorageImpl());
  if (it == u.storages.end()) {
    return false;
  }
  if (it->second.expired()) {
    u.storages.erase(it);
    return false;
  }
  return true;
}

void note_values(const at::Tensor& t, bool unknown) {
  if (!is_supa(t) || !t.has_storage()) {
    return;
  }
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  UnknownValues& u = unknown_values();
  std::lock_guard<std::mutex> lock(u.mutex);
  if (!unknown) {
    u.storages.erase(key);
    return;
  }
  u.storages.insert_or_assign(key, t.storage().getWeakStorageImpl());
  if (u.storages.size() >= u.sweep_at) {
    for (auto it = u.storages.begin(); it != u.storages.end();) {
      it = it->second.expired() ? u.storages.erase(it) : std::next(it);
    }
    u.sweep_at = std::max<size_t>(1024, 2 * u.storages.size());
  }
}

bool reads_unknown_values(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  bool unknown = false;
  for_each_supa_operand(op, stack, [&](const at::Tensor& t) { unknown = unknown || values_unknown(t); });
  return unknown;
}

bool sizes_from_unknown_values(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  bool any_integral = false, integral_unknown = false, any_unknown = false;
  for_each_supa_operand(op, stack, [&](const at::Tensor& t) {
    if (!is_supa(t)) {
      return;
    }
    const bool unknown = values_unknown(t);
    any_unknown = any_unknown || unknown;
    if (at::isIntegralType(t.scalar_type(), /*includeBool=*/true)) {
      any_integral = true;
      integral_unknown = integral_unknown || unknown;
    }
  });
  return any_integral ? integral_unknown : any_unknown;
}

bool values_known_integral(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  bool integral = true;
  for_each_supa_operand(op, stack, [&](const at::Tensor& t) {
    integral = integral && (!is_supa(t) || (t.layout() == c10::kStrided &&
                                            at::isIntegralType(t.scalar_type(), /*includeBool=*/true) &&
                                            !values_unknown(t)));
  });
  return integral;
}

bool is_device_assert(const c10::OperatorHandle& op) {
  return op.schema().name() == "aten::_assert_async";
}

void set_shapes_mode(bool on) {
  g_shapes_mode.store(on);
}

bool shapes_mode() {
  return g_shapes_mode.load(std::memory_order_relaxed);
}

ShapesRoute shapes_route(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& schema = op.schema();
  // .item(), equal(), is_nonzero(): what they return is the values.
  if (op.hasTag(at::Tag::data_dependent_output) || known_without_rule(op)) {
    return ShapesRoute::kKernel;
  }
  uint64_t bytes = 0;
  for (const c10::IValue& value : torch::jit::last(stack, schema.arguments().size())) {
    if (value.isTensor()) {
      if (!add_operand(value.toTensor(), &bytes)) {
        return ShapesRoute::kKernel;
      }
    } else if (value.isList()) {
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor() && !add_operand(item.toTensor(), &bytes)) {
          return ShapesRoute::kKernel;
        }
      }
    }
  }
  const bool small = bytes <= kSmallOperandBytes;
  if (op.hasTag(at::Tag::dynamic_output_shape)) {
    return small ? ShapesRoute::kKernelAfterRule : ShapesRoute::kShapeRuleElseKernel;
  }
  return small ? ShapesRoute::kKernel : ShapesRoute::kShapeRule;
}

namespace {

// Counts a note of `kind` for `qualified`; the first one keeps its Python call site.
void add_note(const std::string& kind, const std::string& qualified) {
  ShapesNotes& s = notes_state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.notes.find({kind, qualified});
    if (it != s.notes.end()) {
      ++it->second.count;
      return;
    }
  }
  // The first call's Python stack (gathered outside the lock: it takes the GIL).
  auto site = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto [it, added] = s.notes.emplace(std::make_pair(kind, qualified), ShapesNote{kind, qualified, 0, site});
  ++it->second.count;
}

}  // namespace

void note_kernel_ran(const c10::OperatorHandle& op, KernelReason reason) {
  const std::string kind = reason == KernelReason::kValueDependent ? "value-dependent" : "no shape rule";
  const auto& name = op.schema().operator_name();
  const std::string qualified = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
  if (reason == KernelReason::kNoShapeRule) {
    ShapesNotes& s = notes_state();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.without_rule.insert(&op.schema());
  }
  add_note(kind, qualified);
}

void note_skipped_check(const std::string& what) {
  add_note("value-dependent", what);
}

bool generated_kernel_runs(const std::vector<at::Tensor>& operands, const std::vector<at::Tensor>& written) {
  uint64_t bytes = 0;
  bool integral_known = true;
  for (const at::Tensor& t : operands) {
    if (!is_supa(t)) {
      continue;
    }
    add_operand(t, &bytes);
    integral_known = integral_known && at::isIntegralType(t.scalar_type(), /*includeBool=*/true) && !values_unknown(t);
  }
  for (const at::Tensor& t : written) {
    integral_known = integral_known && (!is_supa(t) || at::isIntegralType(t.scalar_type(), /*includeBool=*/true));
  }
  return bytes <= kSmallOperandBytes || integral_known;
}

std::vector<ShapesNote> shapes_notes() {
  ShapesNotes& s = notes_state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<ShapesNote> out;
  for (const auto& [key, note] : s.notes) {
    out.push_back(note);
  }
  return out;
}

bool card_bytes_move(uint64_t nbytes) {
  return !shapes_mode() || nbytes <= kSmallOperandBytes;
}

c10::Storage meta_storage(size_t nbytes) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, c10::Device(c10::DeviceType::Meta)),
      c10::GetAllocator(c10::DeviceType::Meta), /*resizable=*/true));
}

namespace {

// A block of `nbytes` on `device`; in shapes mode it reads as zeros (card_memory.h).
c10::DataPtr card_block(size_t nbytes, c10::DeviceIndex device) {
  void* ptr = nbytes == 0 ? nullptr : allocate_block(nbytes, device);
  return {ptr, ptr, &delete_device_ptr, c10::Device(kSupa, device)};
}

}  // namespace

at::Tensor card_result(const at::Tensor& meta, c10::DeviceIndex device) {
  const size_t nbytes = meta.storage().nbytes();
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), nbytes,
                                                             card_block(nbytes, device), device_allocator(),
                                                             /*resizable=*/true));
  return tensor_over(storage, kSupaKeys, meta);
}

void resize_card_storage(c10::StorageImpl* storage, size_t nbytes, c10::DeviceIndex device) {
  storage->set_data_ptr_noswap(card_block(nbytes, device));
  storage->set_nbytes(nbytes);
}

}  // namespace supa
