// The facts behind the memory checker (`SUPA_EMU_SANITIZE=memory`): operand bounds against live
// allocations, and which bytes of uninitialised blocks have been written.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace torch {
struct CapturedTraceback;
}

namespace supa {

// A fault names the operand (index into reads, then writes).
struct MemcheckFault {
  enum Kind { kNone = 0, kOutOfBounds, kFreed, kUninitialized };
  Kind kind = kNone;
  int64_t operand = -1;
  int64_t lo = 0, hi = 0;  // the operand's byte extent from its storage's start
  int64_t live = 0;        // bytes of the live allocation
  uintptr_t base = 0;
  int64_t first_unwritten = -1;
  std::shared_ptr<torch::CapturedTraceback> site;  // where an uninitialised block was allocated
};
void memcheck_set_enabled(bool enabled);
MemcheckFault memcheck_operands(const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes);
void memcheck_written(const std::vector<at::Tensor>& tensors);
void memcheck_uninitialized(const at::Tensor& t);
void memcheck_resized(const void* old_ptr, const void* new_ptr, size_t keep, size_t nbytes);
void memcheck_block_freed(const void* ptr);
size_t memcheck_tracked_blocks();

}  // namespace supa
