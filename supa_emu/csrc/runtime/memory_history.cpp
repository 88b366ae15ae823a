// Allocation history for memory snapshots (`torch.supa.memory._record_memory_history`).
//
// While recording, the caching allocator reports each segment and block it hands out or takes
// back; each event keeps the stack that caused it (Python frames, optionally C++), gathered
// before the allocator takes its lock because gathering Python frames needs the GIL. Events are
// kept in a ring of `max_entries`; the stacks of live blocks are kept for the snapshot's
// per-block "frames".
#include "memory_history.h"

#include <torch/csrc/profiler/combined_traceback.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <unordered_map>

namespace supa {
namespace {

std::mutex g_history_mutex;
std::atomic<bool> g_trace{false};        // record events in the trace
std::atomic<bool> g_stacks{false};       // gather a stack per event / block
std::atomic<bool> g_cpp_stacks{false};   // ... including C++ frames
size_t g_max_entries = 0;
std::deque<MemoryEvent> g_events;
std::unordered_map<const void*, std::shared_ptr<torch::CapturedTraceback>> g_block_stacks;

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void set_memory_history(bool trace, bool stacks, bool cpp_stacks, size_t max_entries) {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  g_trace = trace;
  g_stacks = stacks;
  g_cpp_stacks = cpp_stacks;
  g_max_entries = max_entries;
  if (!trace) {
    g_events.clear();
  }
  if (!stacks) {
    g_block_stacks.clear();
  }
  while (g_events.size() > g_max_entries) {
    g_events.pop_front();
  }
}

std::shared_ptr<torch::CapturedTraceback> memory_event_stack() {
  if (!g_stacks.load(std::memory_order_relaxed)) {
    return nullptr;
  }
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, g_cpp_stacks.load());
}

void record_memory_event(const char* action, c10::DeviceIndex device, const void* ptr, size_t size,
                         const std::shared_ptr<torch::CapturedTraceback>& stack, size_t block_size,
                         int64_t stream) {
  if (!g_trace.load(std::memory_order_relaxed) && !g_stacks.load(std::memory_order_relaxed)) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_history_mutex);
  const std::string name(action);
  if (name == "alloc" && stack) {
    g_block_stacks[ptr] = stack;
  } else if (name == "free_completed") {
    g_block_stacks.erase(ptr);
  }
  if (!g_trace || g_max_entries == 0) {
    return;
  }
  g_events.push_back({name, device, static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)),
                      static_cast<int64_t>(size), static_cast<int64_t>(block_size == 0 ? size : block_size), stream,
                      now_us(), stack});
  if (g_events.size() > g_max_entries) {
    g_events.pop_front();
  }
}

std::vector<MemoryEvent> memory_events() {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  return {g_events.begin(), g_events.end()};
}

std::shared_ptr<torch::CapturedTraceback> block_stack(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  auto it = g_block_stacks.find(ptr);
  return it == g_block_stacks.end() ? nullptr : it->second;
}

}  // namespace supa
