// Device memory as PyTorch sees it: the c10 device allocator over the emulated cards
// (card_memory.h), with the statistics, settings, snapshots and memory-history events of
// PyTorch's CUDA caching allocator. One block table under one mutex, which the allocation path,
// its statistics, settings and snapshots all read.
//
// A request that does not fit its card even after the card released its cache gets
// torch.OutOfMemoryError with the message shape of the real stack. The allocator settings
// that change accounting act as on the real allocator: roundup_power2_divisions rounds request
// sizes, max_split_size makes large blocks "oversize" (counted apart), and
// garbage_collection_threshold releases the least recently freed whole free segments once
// reserved memory passes that fraction of the card (see BlockPolicy). Segments, splitting and
// merging are the card's (card_memory.h); the statistics count them as PyTorch's allocator does
// (inactive_split for the free blocks of split segments, whole blocks in allocated_bytes).
// When a freed block may serve again (record_stream, graph capture) is freed_blocks.cpp's; empty_cache
// waits for the streams it depends on, as a card's does. The state the halves share is in
// allocator_state.h; an operator kernel's provisional allocations, which the card counts only once
// handed back as results, are provisional_blocks.cpp.
#include "caching_allocator.h"

#include "allocator_state.h"
#include "card_memory.h"
#include "device_guard.h"
#include "devices.h"
#include "freed_blocks.h"
#include "gpu_trace.h"
#include "graph.h"
#include "mem_pool.h"
#include "memcheck.h"
#include "memory_history.h"
#include "out_of_memory.h"
#include "provisional_blocks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <unordered_map>

namespace supa {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingDeviceAllocator::DeviceStats;

static_assert(std::is_same_v<PoolId, c10::MempoolId_t>, "card_memory.h's PoolId must be c10's pool id");

}  // namespace

namespace allocator_state {

std::mutex g_mutex;
std::vector<std::unique_ptr<DeviceMemory>> g_devices;
std::unordered_map<void*, CardBlock*> g_blocks;
BlockPolicy g_policy;

}  // namespace allocator_state

namespace {

using namespace allocator_state;

// A segment the card gives back to the host (called by the card, under g_mutex).
void segment_released(DeviceMemory& mem, const CardSegment& segment) {
  record_memory_event("segment_free", static_cast<c10::DeviceIndex>(segment.device), segment.ptr, segment.size,
                      nullptr, segment.size, segment.stream);
  count_block(mem.stats.segment, segment.small, false);
  update(mem.stats.reserved_bytes, segment.small, segment.size, false);
  if (segment.oversize) {
    mem.stats.oversize_segments.decrease(1);
  }
  mem.stats.num_device_free++;
}

// `stack`: the request's, kept with the history's "oom" event (the planner reports where it failed).
[[noreturn]] void raise_oom(DeviceMemory& mem, c10::DeviceIndex device, size_t size, const Stack& stack) {
  mem.stats.num_ooms++;
  record_memory_event("oom", device, nullptr, size, stack);
  throw_card_oom(mem.card, device, size, mem.stats.allocated_bytes[0].current);
}

// Block hand-outs and returns, for the GPU trace (see gpu_trace.h), once a callback listens for them:
// with the trace on for a sanitizer alone, allocations do not call into Python.
std::atomic<bool> g_report_blocks{false};

}  // namespace

namespace allocator_state {

// A statistic moves in "all" and in the pool (small or large) of the block or segment.
void update(StatArray& stat, bool small, int64_t amount) {
  const size_t pool = small ? 1 : 2;
  for (size_t i : {size_t{0}, pool}) {
    amount >= 0 ? stat[i].increase(static_cast<size_t>(amount)) : stat[i].decrease(static_cast<size_t>(-amount));
  }
}

void update(StatArray& stat, bool small, size_t size, bool increase) {
  update(stat, small, increase ? static_cast<int64_t>(size) : -static_cast<int64_t>(size));
}

// Count statistics (allocation, segment, active) move by one per block.
void count_block(StatArray& stat, bool small, bool increase) {
  update(stat, small, increase ? 1 : -1);
}


void count_inactive_split(DeviceStats& stats, bool small, int blocks, int64_t bytes) {
  update(stats.inactive_split, small, blocks);
  update(stats.inactive_split_bytes, small, bytes);
}

DeviceMemory::DeviceMemory(c10::DeviceIndex device, int64_t capacity, Backing backing)
    : card(
          device, capacity, [this](const CardSegment& segment) { segment_released(*this, segment); }, backing,
          {[](const PoolId& pool) { return pool_use_count(pool) > 0; }, &pool_use_on_oom, &pool_no_split}) {}

DeviceMemory& memory_of(c10::DeviceIndex device) {
  check_device_index(device);
  return *g_devices.at(device);
}

[[noreturn]] void raise_host_oom(DeviceMemory& mem, c10::DeviceIndex device, size_t size, int error) {
  mem.stats.num_ooms++;
  throw_host_oom(mem.card, device, size, error);
}

void report_block(void* ptr, bool allocated) {
  if (!g_report_blocks.load(std::memory_order_relaxed)) {
    return;
  }
  report_to_gpu_trace([&](const auto& trace) {
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    if (allocated) {
      trace->trace_gpu_memory_allocation(kSupa, address);
    } else {
      trace->trace_gpu_memory_deallocation(kSupa, address);
    }
  });
}

// The block size that serves a request; raises for a request no card could hold.
size_t block_size(size_t nbytes, c10::DeviceIndex /*device*/) {
  // Refused before any card is asked, as CUDA's allocator does (not counted as an OOM; rounding
  // such a size up would wrap around).
  TORCH_CHECK_WITH(OutOfMemoryError, nbytes < kLargestRequest,
                   "SUPA out of memory. Tried to allocate more than 1EB memory.");
  return g_policy.round_size(nbytes);
}

// Counts a block the card handed out for a request of `nbytes` as allocated (under g_mutex).
CardBlock* count_placed(DeviceMemory& mem, c10::DeviceIndex device, const Placement& placed, size_t nbytes,
                        const Stack& stack, bool split_counted) {
  CardBlock* block = placed.block;
  const bool small = block->small;
  if (const CardSegment* segment = placed.segment) {
    record_memory_event("segment_alloc", device, segment->ptr, segment->size, stack, segment->size, segment->stream);
    mem.stats.num_device_alloc++;
    count_block(mem.stats.segment, small, true);
    update(mem.stats.reserved_bytes, small, segment->size, true);
    if (segment->oversize) {
      mem.stats.oversize_segments.increase(1);
    }
  }
  if (!split_counted) {
    count_inactive_split(mem.stats, small, placed.inactive_split, placed.inactive_split_bytes);
  }
  g_blocks.emplace(block->ptr, block);
  block->allocated = true;
  block->requested = nbytes;
  count_block(mem.stats.allocation, small, true);
  count_block(mem.stats.active, small, true);
  update(mem.stats.allocated_bytes, small, block->size, true);
  update(mem.stats.active_bytes, small, block->size, true);
  update(mem.stats.requested_bytes, small, nbytes, true);
  if (block->oversize) {
    mem.stats.oversize_allocations.increase(1);
  }
  record_memory_event("alloc", device, block->ptr, nbytes, stack, block->size, block->stream);
  // As CUDA's allocator: the profiler's memory view (profile_memory=True) sees each block.
  c10::reportMemoryUsageToProfiler(block->ptr, static_cast<int64_t>(block->size), mem.stats.allocated_bytes[0].current,
                                   mem.stats.reserved_bytes[0].current, c10::Device(kSupa, device));
  return block;
}

// A block for a request of `nbytes` on `stream`, counted as allocated (under g_mutex).
CardBlock* place_block(DeviceMemory& mem, c10::DeviceIndex device, size_t nbytes, const c10::MempoolId_t& pool,
                       c10::StreamId stream, const Stack& stack) {
  const size_t size = g_policy.round_size(nbytes);
  const Placement placed = mem.card.place(size, pool, g_policy, stream);
  mem.stats.num_alloc_retries += placed.retries;
  if (placed.block == nullptr) {
    if (placed.host_error != 0) {
      raise_host_oom(mem, device, size, placed.host_error);
    }
    raise_oom(mem, device, size, stack);
  }
  return count_placed(mem, device, placed, nbytes, stack);
}

}  // namespace allocator_state

void free_block(void* ptr) {
  if (drop_provisional(ptr)) {
    return;
  }
  report_block(ptr, false);
  memcheck_block_freed(ptr);
  const auto stack = memory_event_stack();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(ptr);
  TORCH_INTERNAL_ASSERT(it != g_blocks.end(), "supa_emu: freeing unknown device pointer");
  CardBlock* block = it->second;
  g_blocks.erase(it);
  DeviceMemory& mem = *g_devices.at(block->device);
  const auto device = static_cast<c10::DeviceIndex>(block->device);
  const bool small = block->small;
  count_block(mem.stats.allocation, small, false);
  update(mem.stats.allocated_bytes, small, block->size, false);
  update(mem.stats.requested_bytes, small, block->requested, false);
  if (block->oversize) {
    mem.stats.oversize_allocations.decrease(1);
  }
  // The history names what was asked for, as the card's does; the statistics count whole blocks.
  const size_t size = block->size, requested = block->requested;
  const int64_t stream = block->stream;
  record_memory_event("free_requested", device, ptr, requested, stack, size, stream);
  c10::reportMemoryUsageToProfiler(ptr, -static_cast<int64_t>(size), mem.stats.allocated_bytes[0].current,
                                   mem.stats.reserved_bytes[0].current, c10::Device(kSupa, device));
  if (!block->used_on.empty() && mem.captures_underway > 0) {
    mem.capture_frees.push_back({block, capture_free_points(device, *block)});
  } else {
    release_after_uses(mem, device, block);
  }
  record_memory_event("free_completed", device, ptr, requested, stack, size, stream);
}

std::optional<c10::MempoolId_t> block_pool(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(const_cast<void*>(ptr));
  if (it == g_blocks.end()) {
    return std::nullopt;
  }
  return it->second->pool;
}

void delete_device_ptr(void* ptr) {
  if (ptr != nullptr) {
    free_block(ptr);
  }
}

namespace {

void* hand_out_block(size_t nbytes, c10::DeviceIndex device) {
  block_size(nbytes, device);
  const auto stack = memory_event_stack();
  const c10::MempoolId_t pool = allocation_pool(device);
  const c10::StreamId stream = current_stream_id(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceMemory& mem = memory_of(device);
  settle_capture_frees(mem, device, stream);
  settle_pending_frees(mem, /*wait=*/false);
  return place_block(mem, device, nbytes, pool, stream, stack)->ptr;
}

}  // namespace

void report_blocks_to_gpu_trace() {
  g_report_blocks.store(true);
}

void* allocate_block(size_t nbytes, c10::DeviceIndex device) {
  void* ptr = hand_out_block(nbytes, device);
  report_block(ptr, true);
  return ptr;
}

namespace {

template <typename Fn>
void for_each_stat(DeviceStats& s, Fn fn) {
  for (StatArray* arr : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                         &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
    for (Stat& stat : *arr) {
      fn(stat);
    }
  }
  fn(s.oversize_allocations);
  fn(s.oversize_segments);
}

class SupaDeviceAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    if (nbytes == 0) {
      return {nullptr, nullptr, &delete_device_ptr, c10::Device(kSupa, device)};
    }
    void* ptr = allocate_block(nbytes, device);
    return {ptr, ptr, &delete_device_ptr, c10::Device(kSupa, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_device_ptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool initialized() override {
    return device_count() > 0;
  }
  void emptyCache(c10::MempoolId_t pool) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    const bool general = pool.first == 0 && pool.second == 0;
    for (auto& mem : g_devices) {
      if (general && !is_capturing()) {
        // As a card's allocator: wait for every stream's use of freed blocks, then release.
        ++mem->stats.num_sync_all_streams;
        settle_pending_frees(*mem, /*wait=*/true);
      }
      mem->card.release_cached(general ? nullptr : &pool);  // general: the pools not in use
    }
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (ptr.get() == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.find(ptr.get_context());
    if (it == g_blocks.end()) {
      return;  // not a block of the caching allocator (a provisional result, IPC memory): nothing waits
    }
    CardBlock* block = it->second;
    if (stream.id() != block->stream &&
        std::find(block->used_on.begin(), block->used_on.end(), stream.id()) == block->used_on.end()) {
      block->used_on.push_back(stream.id());
    }
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    return memory_of(device).stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceStats& s = memory_of(device).stats;
    for_each_stat(s, [](Stat& stat) { stat.reset_accumulated(); });
    s.num_alloc_retries = 0;
    s.num_ooms = 0;
    s.num_sync_all_streams = 0;
    s.num_device_alloc = 0;
    s.num_device_free = 0;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    for_each_stat(memory_of(device).stats, [](Stat& stat) { stat.reset_peak(); });
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceMemory& mem = memory_of(device);
    return {static_cast<size_t>(mem.card.unreserved()), static_cast<size_t>(mem.card.capacity())};
  }
};

SupaDeviceAllocator g_device_allocator;

}  // namespace

void init_memory(const std::vector<int64_t>& capacities, bool lazy_backing) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(g_devices.empty(), "supa_emu: the emulated devices are already initialised");
  const Backing backing = lazy_backing ? Backing::kReservedAddressSpace : Backing::kHeap;
  for (int64_t capacity : capacities) {
    auto mem = std::make_unique<DeviceMemory>(static_cast<c10::DeviceIndex>(g_devices.size()), capacity, backing);
    mem->stats.max_split_size = g_policy.max_split_size;
    g_devices.push_back(std::move(mem));
  }
  c10::SetAllocator(kSupa, &g_device_allocator);
}

c10::DeviceAllocator* device_allocator() {
  return &g_device_allocator;
}

namespace {

// The segment of any card that holds `ptr` (under g_mutex).
const CardSegment* segment_of(const void* ptr) {
  for (const auto& mem : g_devices) {
    if (const CardSegment* segment = mem->card.segment_of(ptr)) {
      return segment;
    }
  }
  return nullptr;
}

}  // namespace

c10::DeviceIndex device_of_ptr(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (auto it = g_blocks.find(const_cast<void*>(ptr)); it != g_blocks.end()) {
    return static_cast<c10::DeviceIndex>(it->second->device);
  }
  if (const c10::DeviceIndex device = provisional_device(ptr); device >= 0) {
    return device;
  }
  const CardSegment* segment = segment_of(ptr);
  return segment == nullptr ? -1 : static_cast<c10::DeviceIndex>(segment->device);
}

std::optional<LiveBlock> live_block(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (auto it = g_blocks.find(const_cast<void*>(ptr)); it != g_blocks.end()) {
    return LiveBlock{true, it->second->requested};
  }
  // Not the start of an allocated block: inside a segment, it is memory that was freed (or a
  // pointer into the middle of a block, which no storage starts at).
  if (segment_of(ptr) != nullptr) {
    return LiveBlock{false, 0};
  }
  return std::nullopt;
}

void set_memory_fraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "Invalid fraction value: ", fraction, ". Allowed range: 0~1");
  std::lock_guard<std::mutex> lock(g_mutex);
  memory_of(device).card.set_fraction(fraction);
}

double get_memory_fraction(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return memory_of(device).card.fraction();
}

void set_allocator_knobs(int64_t max_split_size, double gc_threshold, const std::vector<int64_t>& divisions,
                         bool capture_record_stream_reuse) {
  TORCH_CHECK(divisions.size() == kRoundUpIntervals, "supa_emu: expected ", kRoundUpIntervals,
              " roundup_power2_divisions intervals, got ", divisions.size());
  std::lock_guard<std::mutex> lock(g_mutex);
  set_capture_record_stream_reuse(capture_record_stream_reuse);
  // Blocks keep the oversize status they were created with, so the counters stay balanced.
  g_policy.max_split_size = max_split_size < 0 ? -1 : max_split_size;
  g_policy.gc_threshold = gc_threshold;
  for (size_t i = 0; i < kRoundUpIntervals; ++i) {
    g_policy.divisions[i] = static_cast<size_t>(divisions[i]);
  }
  for (auto& mem : g_devices) {
    mem->stats.max_split_size = g_policy.max_split_size;
  }
}

int64_t capacity(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return memory_of(device).card.capacity();
}

std::vector<SegmentInfo> segment_snapshot(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<SegmentInfo> out;
  for (const auto& mem : g_devices) {
    for (const auto& entry : mem->card.segments()) {
      const CardSegment& segment = *entry.second;
      if (device >= 0 && segment.device != device) {
        continue;
      }
      SegmentInfo info{segment.device, entry.first, segment.size, 0, 0, 0, segment.small, segment.pool, segment.stream,
                       {}};
      for (const CardBlock* b : mem->card.blocks_of(segment)) {
        // The card holds a freed block until the streams that used it pass the free: active, not allocated.
        const bool allocated = b->allocated && g_blocks.count(b->ptr) != 0;
        info.blocks.push_back({reinterpret_cast<uintptr_t>(b->ptr), b->size, b->requested, allocated, b->allocated});
        if (allocated) {
          info.allocated_size += b->size;
          info.requested_size += b->requested;
        }
        if (b->allocated) {
          info.active_size += b->size;
        }
      }
      out.push_back(std::move(info));
    }
  }
  return out;
}

void* raw_alloc(size_t nbytes, c10::DeviceIndex device) {
  return nbytes == 0 ? nullptr : allocate_block(nbytes, device);
}

void raw_delete(void* ptr) {
  delete_device_ptr(ptr);
}

}  // namespace supa
