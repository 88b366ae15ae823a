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
  std::shared_ptr<torch::CapturedTraceback> stack;  // null when the context level keeps none for it
  std::string compile_context;                      // the Torch-Compiled Region it ran in, or "N/A"
  std::string user_metadata;                        // `_set_memory_metadata` when it was recorded
};

// A record_function range entered or left while recording (the snapshot's "external_annotations").
struct MemoryAnnotation {
  std::string name;
  std::string stage;  // START, END
  c10::DeviceIndex device;
  int64_t time_us;
};

// Which stacks are kept, as torch.cuda's `context=`: kState those of live blocks (the snapshot's
// block frames), kAlloc also those of the trace's allocations (frees then show the stack of the
// allocation they free), kAll also the stacks of the frees themselves.
enum class StackContext { kNever = 0, kState = 1, kAlloc = 2, kAll = 3 };

struct HistorySettings {
  bool recording = false;   // events go to the trace (a ring of max_entries)
  StackContext context = StackContext::kNever;
  bool cpp_stacks = false;  // stacks include C++ frames
  size_t max_entries = 0;
  bool clear = false;               // drop the trace recorded so far
  bool compile_context = false;     // events name the Torch-Compiled Region they ran in
  bool global_annotations = false;  // annotations from every thread, not only the caller's
  std::vector<std::string> skip_actions;  // actions left out of the trace
};
void set_memory_history(const HistorySettings& settings);
// The string `_set_memory_metadata` attaches to the events recorded from now on ("" for none).
void set_memory_metadata(std::string metadata);
std::string memory_metadata();

// How the history asks whether this thread holds the GIL (the bindings give PyGILState_Check;
// until they do, it never gathers under the allocator's lock).
void set_gil_probe(bool (*holds_gil)());

// The caller's stack when stacks are recorded, else null. Call without allocator locks held.
std::shared_ptr<torch::CapturedTraceback> memory_event_stack();
// `stack`: the one memory_event_stack() gave for the request. A segment given back without one
// (empty_cache) gets the caller's when the context level keeps free stacks and this thread holds
// the GIL, so that gathering Python frames waits for nothing under the allocator's lock.
void record_memory_event(const char* action, c10::DeviceIndex device, const void* ptr, size_t size,
                         const std::shared_ptr<torch::CapturedTraceback>& stack, size_t block_size = 0,
                         int64_t stream = 0);
// Whether record_memory_event records anything now: a check for a caller that makes several events
// (a free makes two), so that without history each costs nothing.
bool memory_events_wanted();
std::vector<MemoryEvent> memory_events();
std::vector<MemoryAnnotation> memory_annotations();
// The stack recorded when the live block at `ptr` was allocated, or null. A block keeps it until it
// is freed, whether or not history is still recorded then, as CUDA's blocks do.
std::shared_ptr<torch::CapturedTraceback> block_stack(const void* ptr);

}  // namespace supa
