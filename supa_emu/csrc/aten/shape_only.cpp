// Shapes mode (see shape_only.h): which calls take their shape rule, and the card memory that
// stands for a skipped kernel's results.
#include "shape_only.h"

#include "../runtime/caching_allocator.h"
#include "../runtime/devices.h"
#include "../runtime/host_alias.h"

#include <c10/core/Allocator.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <atomic>
#include <map>
#include <mutex>
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

bool returns_tensors(const c10::FunctionSchema& schema) {
  for (const auto& result : schema.returns()) {
    const c10::TypePtr& type = result.type();
    if (type->isSubtypeOf(*c10::TensorType::get()) || type->isSubtypeOf(*c10::ListType::ofTensors()) ||
        type->isSubtypeOf(*c10::OptionalType::ofTensor())) {
      return true;
    }
  }
  return false;
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

}  // namespace

void set_shapes_mode(bool on) {
  g_shapes_mode.store(on);
}

bool shapes_mode() {
  return g_shapes_mode.load(std::memory_order_relaxed);
}

ShapesRoute shapes_route(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& schema = op.schema();
  // .item(), equal(), is_nonzero(): what they return is the values.
  if (op.hasTag(at::Tag::data_dependent_output) || !returns_tensors(schema) || known_without_rule(op)) {
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

void note_kernel_ran(const c10::OperatorHandle& op, KernelReason reason) {
  const std::string kind = reason == KernelReason::kValueDependent ? "value-dependent" : "no shape rule";
  const auto& name = op.schema().operator_name();
  const std::string qualified = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
  ShapesNotes& s = notes_state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (reason == KernelReason::kNoShapeRule) {
      s.without_rule.insert(&op.schema());
    }
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
