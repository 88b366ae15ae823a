// Allocation history for memory snapshots (`torch.supa.memory._record_memory_history`).
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace torch {
struct CapturedTraceback;
}

namespace supa {

struct MemoryEvent {
  std::string action;  // alloc, free_requested, free_completed, segment_alloc, segment_free, oom
  c10::DeviceIndex device;
  int64_t addr;
  int64_t size;        // what was asked for (a segment's size for segment events), as the card records it
  int64_t block_size;  // the bytes it holds on the card: the planner's figures count these
  int64_t stream;
  int64_t time_us;
  std::shared_ptr<torch::CapturedTraceback> stack;  // null when stacks are not recorded
};
void set_memory_history(bool trace, bool stacks, bool cpp_stacks, size_t max_entries);
// The caller's stack when stacks are recorded, else null. Call without allocator locks held.
std::shared_ptr<torch::CapturedTraceback> memory_event_stack();
void record_memory_event(const char* action, c10::DeviceIndex device, const void* ptr, size_t size,
                         const std::shared_ptr<torch::CapturedTraceback>& stack, size_t block_size = 0,
                         int64_t stream = 0);
std::vector<MemoryEvent> memory_events();
// The stack recorded when the live block at `ptr` was allocated, or null.
std::shared_ptr<torch::CapturedTraceback> block_stack(const void* ptr);

}  // namespace supa
