// Allocation history for memory snapshots (`torch.supa.memory._record_memory_history`).
//
// While recording, the caching allocator reports each segment and block it hands out or takes
// back; each event keeps the stack that caused it (Python frames, optionally C++), gathered
// before the allocator takes its lock because gathering Python frames needs the GIL. Which
// stacks are kept follows torch.cuda's context levels (StackContext). Events are kept in a ring
// of `max_entries` ("state" keeps one, as CUDA's does); the stacks of live blocks are kept for the
// snapshot's per-block "frames" until the blocks are freed. Each event also names the compiled
// region it ran in and the user's metadata; record_function ranges are kept beside the events.
#include "memory_history.h"

#include "devices.h"

#include <ATen/record_function.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <unordered_map>

namespace supa {
namespace {

using Stack = std::shared_ptr<torch::CapturedTraceback>;

std::mutex g_history_mutex;
std::atomic<bool> g_recording{false};  // events go to the trace
std::atomic<int> g_context{0};         // a StackContext
std::atomic<bool> g_cpp_stacks{false};
std::atomic<bool> g_compile_context{false};
std::atomic<bool> g_live_stacks{false};  // some live block or segment holds a stack
std::atomic<bool (*)()> g_holds_gil{nullptr};
size_t g_max_entries = 0;
std::vector<std::string> g_skip_actions;
std::string g_metadata;
std::deque<MemoryEvent> g_events;
std::unordered_map<const void*, Stack> g_block_stacks;    // live blocks, by address
std::unordered_map<const void*, Stack> g_segment_stacks;  // live segments: the request that reserved each

StackContext context_level() {
  return static_cast<StackContext>(g_context.load(std::memory_order_relaxed));
}

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Stack gather_stack() {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, g_cpp_stacks.load());
}

// Record-function ranges the history follows while it records: Torch-Compiled Regions (Dynamo runs
// each compiled frame inside a record function of that name), named in each event's
// compile_context, and user ranges (torch.profiler.record_function), kept as annotations.
constexpr char kCompiledRegion[] = "Torch-Compiled Region";
std::deque<MemoryAnnotation> g_annotations;  // under g_history_mutex, a ring of g_max_entries

std::mutex g_watch_mutex;
at::CallbackHandle g_regions_watch = 0;
at::CallbackHandle g_annotations_watch = 0;

// The regions this thread runs in, innermost last. A watch removed while a thread was inside a
// region never sees it left, so each watch starts a new generation that discards older entries.
std::atomic<uint64_t> g_region_generation{0};
struct CompiledRegions {
  uint64_t generation = 0;
  std::vector<std::string> names;
};
thread_local CompiledRegions t_regions;

std::vector<std::string>& compiled_regions() {
  const uint64_t generation = g_region_generation.load(std::memory_order_relaxed);
  if (t_regions.generation != generation) {
    t_regions.names.clear();
    t_regions.generation = generation;
  }
  return t_regions.names;
}

struct EnteredRegion : at::ObserverContext {};

std::unique_ptr<at::ObserverContext> region_entered(const at::RecordFunction& fn) {
  if (std::strncmp(fn.name(), kCompiledRegion, sizeof(kCompiledRegion) - 1) != 0) {
    return nullptr;
  }
  compiled_regions().emplace_back(fn.name());
  return std::make_unique<EnteredRegion>();
}

void region_left(const at::RecordFunction& /*fn*/, at::ObserverContext* entered) {
  auto& regions = compiled_regions();
  if (entered != nullptr && !regions.empty()) {
    regions.pop_back();
  }
}

void annotate(const at::RecordFunction& fn, const char* stage) {
  if (!g_recording.load(std::memory_order_relaxed)) {
    return;
  }
  MemoryAnnotation annotation{fn.name(), stage, current_device(), now_us()};
  std::lock_guard<std::mutex> lock(g_history_mutex);
  g_annotations.push_back(std::move(annotation));
  while (g_annotations.size() > g_max_entries) {
    g_annotations.pop_front();
  }
}

std::unique_ptr<at::ObserverContext> annotation_entered(const at::RecordFunction& fn) {
  annotate(fn, "START");
  return nullptr;
}

void annotation_left(const at::RecordFunction& fn, at::ObserverContext* /*unused*/) {
  annotate(fn, "END");
}

// As CUDA's history: user ranges are followed on the calling thread (every thread with
// `global_annotations`) and compiled regions everywhere, while recording; the watches go when
// recording stops, so that an unrecorded run pays nothing for them.
void watch_record_functions(const HistorySettings& settings) {
  std::lock_guard<std::mutex> lock(g_watch_mutex);
  if (!settings.recording) {
    for (at::CallbackHandle* watch : {&g_annotations_watch, &g_regions_watch}) {
      if (*watch != 0) {
        at::removeCallback(*watch);
        *watch = 0;
      }
    }
    return;
  }
  if (g_annotations_watch == 0) {
    auto watch = at::RecordFunctionCallback(&annotation_entered, &annotation_left).scopes({at::RecordScope::USER_SCOPE});
    g_annotations_watch = settings.global_annotations ? at::addGlobalCallback(watch) : at::addThreadLocalCallback(watch);
  }
  if (settings.compile_context && g_regions_watch == 0) {
    g_region_generation.fetch_add(1);
    g_regions_watch = at::addGlobalCallback(
        at::RecordFunctionCallback(&region_entered, &region_left).scopes({at::RecordScope::FUNCTION}));
  }
}

bool is_free(const std::string& action) {
  return action == "free_requested" || action == "free_completed";
}

// The stack an event keeps in the trace: an allocation's own from kAlloc; a free's own at kAll,
// below that the stack of what it frees (as CUDA's trace shows it).
Stack trace_stack(const std::string& action, const void* ptr, const Stack& stack) {
  const StackContext level = context_level();
  if (level < StackContext::kAlloc) {
    return nullptr;
  }
  const bool frees_block = is_free(action);
  if (!frees_block && action != "segment_free") {
    return stack;
  }
  if (level == StackContext::kAll) {
    bool (*holds_gil)() = g_holds_gil.load();
    if (stack || frees_block || holds_gil == nullptr || !holds_gil()) {
      return stack;
    }
    return gather_stack();  // a segment given back by empty_cache: see record_memory_event
  }
  const auto& owners = frees_block ? g_block_stacks : g_segment_stacks;
  auto it = owners.find(ptr);
  return it == owners.end() ? nullptr : it->second;
}

}  // namespace

void set_memory_history(const HistorySettings& settings) {
  watch_record_functions(settings);
  std::lock_guard<std::mutex> lock(g_history_mutex);
  g_recording = settings.recording;
  g_context = static_cast<int>(settings.recording ? settings.context : StackContext::kNever);
  g_cpp_stacks = settings.cpp_stacks;
  g_compile_context = settings.compile_context && settings.recording;
  g_max_entries = settings.max_entries;
  g_skip_actions = settings.skip_actions;
  if (!settings.recording || settings.clear) {
    g_events.clear();
    g_annotations.clear();
  }
  while (g_events.size() > g_max_entries) {
    g_events.pop_front();
  }
  while (g_annotations.size() > g_max_entries) {
    g_annotations.pop_front();
  }
}

void set_gil_probe(bool (*holds_gil)()) {
  g_holds_gil = holds_gil;
}

void set_memory_metadata(std::string metadata) {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  g_metadata = std::move(metadata);
}

std::string memory_metadata() {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  return g_metadata;
}

Stack memory_event_stack() {
  if (context_level() == StackContext::kNever) {
    return nullptr;
  }
  return gather_stack();
}

bool memory_events_wanted() {
  return g_recording.load(std::memory_order_relaxed) || g_live_stacks.load(std::memory_order_relaxed);
}

void record_memory_event(const char* action, c10::DeviceIndex device, const void* ptr, size_t size,
                         const Stack& stack, size_t block_size, int64_t stream) {
  if (!memory_events_wanted()) {
    return;
  }
  const std::string name(action);
  // The allocator's lock is held here. Gathering a stack (trace_stack, for a segment given back
  // without one) needs only the GIL, and only a thread that already holds it gathers.
  std::lock_guard<std::mutex> lock(g_history_mutex);
  const bool traced = g_recording && g_max_entries > 0 &&
                      std::find(g_skip_actions.begin(), g_skip_actions.end(), name) == g_skip_actions.end();
  Stack kept = traced ? trace_stack(name, ptr, stack) : nullptr;
  if (g_recording && context_level() >= StackContext::kState && stack) {
    if (name == "alloc") {
      g_block_stacks[ptr] = stack;
    } else if (name == "segment_alloc") {
      g_segment_stacks[ptr] = stack;
    }
  }
  if (name == "free_completed") {
    g_block_stacks.erase(ptr);
  } else if (name == "segment_free") {
    g_segment_stacks.erase(ptr);
  }
  g_live_stacks = !g_block_stacks.empty() || !g_segment_stacks.empty();
  if (!traced) {
    return;
  }
  std::string region = "N/A";
  if (g_compile_context && !compiled_regions().empty()) {
    region = compiled_regions().back();
  }
  g_events.push_back({name, device, static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)),
                      static_cast<int64_t>(size), static_cast<int64_t>(block_size == 0 ? size : block_size), stream,
                      now_us(), std::move(kept), std::move(region), g_metadata});
  if (g_events.size() > g_max_entries) {
    g_events.pop_front();
  }
}

std::vector<MemoryEvent> memory_events() {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  return {g_events.begin(), g_events.end()};
}

std::vector<MemoryAnnotation> memory_annotations() {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  return {g_annotations.begin(), g_annotations.end()};
}

Stack block_stack(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_history_mutex);
  auto it = g_block_stacks.find(ptr);
  return it == g_block_stacks.end() ? nullptr : it->second;
}

}  // namespace supa
