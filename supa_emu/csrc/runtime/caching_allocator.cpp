// Device memory as PyTorch sees it: the c10 device allocator of `supa` over the emulated cards,
// each with its own caching allocator (card_allocator.h: blocks, statistics, settings, snapshots,
// memory-history events, as PyTorch's CUDA caching allocator keeps them per device), and one
// table of whose pointer each block handed out is (block_table.h), as CUDA's allocator keeps its
// allocated blocks beside its per-device allocators.
//
// A request that does not fit its card even after the card released its cache gets
// torch.OutOfMemoryError with the message shape of the real stack. The allocator settings
// that change accounting act as on the real allocator: roundup_power2_divisions rounds request
// sizes, max_split_size makes large blocks "oversize" (counted apart), and
// garbage_collection_threshold releases the least recently freed whole free segments once
// reserved memory passes that fraction of the card (see BlockPolicy). Segments, splitting and
// merging are the card's (card_memory.h). When a freed block may serve again (record_stream, graph
// capture) is freed_blocks.cpp's; empty_cache waits for the streams it depends on, as a card's
// does. An operator kernel's provisional allocations, which the card counts only once handed back
// as results, are provisional_blocks.cpp's.
#include "caching_allocator.h"

#include "block_table.h"
#include "card_allocator.h"
#include "device_guard.h"
#include "devices.h"
#include "gpu_trace.h"
#include "graph.h"
#include "mem_pool.h"
#include "memcheck.h"
#include "memory_history.h"
#include "provisional_blocks.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>

namespace supa {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;

static_assert(std::is_same_v<PoolId, c10::MempoolId_t>, "card_memory.h's PoolId must be c10's pool id");

// The cards' allocators, created once (init_memory) and kept until the process exits, the table
// of the blocks they handed out, and the settings each card is given.
class CachingAllocator final : public c10::DeviceAllocator {
 public:
  void init(const std::vector<int64_t>& capacities, Backing backing) {
    std::lock_guard<std::mutex> lock(settings_mutex_);
    TORCH_CHECK(cards_.empty(), "supa_emu: the emulated devices are already initialised");
    for (int64_t capacity : capacities) {
      auto card = std::make_unique<CardAllocator>(static_cast<c10::DeviceIndex>(cards_.size()), capacity, backing,
                                                  table_);
      card->set_policy(policy_, capture_record_stream_reuse_);
      cards_.push_back(std::move(card));
    }
  }
  CardAllocator& card(c10::DeviceIndex device) {
    if (device >= 0 && static_cast<size_t>(device) < cards_.size()) {  // every allocation and free asks
      return *cards_[device];
    }
    check_device_index(device);  // raises as the runtime does
    return *cards_.at(device);
  }
  BlockTable& table() { return table_; }
  const std::vector<std::unique_ptr<CardAllocator>>& cards() const { return cards_; }
  void set_policy(const BlockPolicy& policy, bool capture_record_stream_reuse) {
    std::lock_guard<std::mutex> lock(settings_mutex_);
    policy_ = policy;
    capture_record_stream_reuse_ = capture_record_stream_reuse;
    for (auto& card : cards_) {
      card->set_policy(policy_, capture_record_stream_reuse_);
    }
  }

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
    const bool general = pool.first == 0 && pool.second == 0;
    for (auto& card : cards_) {
      card->empty_cache(general ? nullptr : &pool, /*wait_for_streams=*/general && !is_capturing());
    }
  }
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    if (ptr.get() == nullptr) {
      return;
    }
    // Not a block of the caching allocator (a provisional result, IPC memory): nothing waits.
    if (CardBlock* block = table_.find_block(ptr.get_context())) {
      card(static_cast<c10::DeviceIndex>(block->device)).record_stream(block, stream.id());
    }
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    return card(device).stats();
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    card(device).reset_accumulated_stats();
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    card(device).reset_peak_stats();
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    return card(device).memory_info();
  }

 private:
  std::vector<std::unique_ptr<CardAllocator>> cards_;  // fixed once initialised
  BlockTable table_;
  std::mutex settings_mutex_;  // the settings and the cards' creation
  BlockPolicy policy_;         // `_set_allocator_settings`
  bool capture_record_stream_reuse_ = false;
};

CachingAllocator g_allocator;

// Block hand-outs and returns, for the GPU trace (see gpu_trace.h), once a callback listens for them:
// with the trace on for a sanitizer alone, allocations do not call into Python.
std::atomic<bool> g_report_blocks{false};

}  // namespace

CardAllocator& card_allocator(c10::DeviceIndex device) {
  return g_allocator.card(device);
}

BlockTable& block_table() {
  return g_allocator.table();
}

void check_request_size(size_t nbytes) {
  // Refused before any card is asked, as CUDA's allocator does (not counted as an OOM; rounding
  // such a size up would wrap around).
  TORCH_CHECK_WITH(OutOfMemoryError, nbytes < kLargestRequest,
                   "SUPA out of memory. Tried to allocate more than 1EB memory.");
}

void report_block_to_gpu_trace(void* ptr, bool allocated) {
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

void report_blocks_to_gpu_trace() {
  g_report_blocks.store(true);
}

void free_block(void* ptr) {
  report_block_to_gpu_trace(ptr, false);
  memcheck_block_freed(ptr);
  const auto stack = memory_event_stack();
  CardBlock* block = g_allocator.table().remove_block(ptr);
  TORCH_INTERNAL_ASSERT(block != nullptr, "supa_emu: freeing unknown device pointer");
  g_allocator.card(static_cast<c10::DeviceIndex>(block->device)).free(block, stack);
}

void delete_device_ptr(void* ptr) {
  if (ptr != nullptr) {
    free_block(ptr);
  }
}

std::optional<c10::MempoolId_t> block_pool(const void* ptr) {
  std::optional<c10::MempoolId_t> pool;
  g_allocator.table().read_block(ptr, [&](const CardBlock& block) { pool = block.pool; });
  return pool;
}

void* allocate_block(size_t nbytes, c10::DeviceIndex device) {
  check_request_size(nbytes);
  const auto stack = memory_event_stack();
  void* ptr = g_allocator.card(device).allocate(nbytes, allocation_pool(device), current_stream_id(device), stack)->ptr;
  report_block_to_gpu_trace(ptr, true);
  return ptr;
}

void init_memory(const std::vector<int64_t>& capacities, bool lazy_backing) {
  g_allocator.init(capacities, lazy_backing ? Backing::kReservedAddressSpace : Backing::kHeap);
  c10::SetAllocator(kSupa, &g_allocator);
}

c10::DeviceAllocator* device_allocator() {
  return &g_allocator;
}

c10::DeviceIndex device_of_ptr(const void* ptr) {
  c10::DeviceIndex device = -1;
  if (g_allocator.table().read_block(ptr, [&](const CardBlock& block) { device = block.device; })) {
    return device;
  }
  if (const ProvisionalBlock* block = g_allocator.table().find_provisional(ptr)) {
    return block->device;
  }
  for (const auto& card : g_allocator.cards()) {
    if (card->holds(ptr)) {
      return card->device();
    }
  }
  return -1;
}

std::optional<LiveBlock> live_block(const void* ptr) {
  size_t requested = 0;
  if (g_allocator.table().read_block(ptr, [&](const CardBlock& block) { requested = block.requested; })) {
    return LiveBlock{true, requested};
  }
  // Not the start of an allocated block: inside a segment, it is memory that was freed (or a
  // pointer into the middle of a block, which no storage starts at).
  for (const auto& card : g_allocator.cards()) {
    if (card->holds(ptr)) {
      return LiveBlock{false, 0};
    }
  }
  return std::nullopt;
}

void set_memory_fraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "Invalid fraction value: ", fraction, ". Allowed range: 0~1");
  g_allocator.card(device).set_fraction(fraction);
}

double get_memory_fraction(c10::DeviceIndex device) {
  return g_allocator.card(device).fraction();
}

void set_allocator_knobs(int64_t max_split_size, double gc_threshold, const std::vector<int64_t>& divisions,
                         bool capture_record_stream_reuse, bool expandable_segments) {
  TORCH_CHECK(divisions.size() == kRoundUpIntervals, "supa_emu: expected ", kRoundUpIntervals,
              " roundup_power2_divisions intervals, got ", divisions.size());
  BlockPolicy policy;
  policy.max_split_size = max_split_size < 0 ? -1 : max_split_size;
  policy.gc_threshold = gc_threshold;
  policy.expandable = expandable_segments;
  for (size_t i = 0; i < kRoundUpIntervals; ++i) {
    policy.divisions[i] = static_cast<size_t>(divisions[i]);
  }
  g_allocator.set_policy(policy, capture_record_stream_reuse);
}

int64_t capacity(c10::DeviceIndex device) {
  return g_allocator.card(device).capacity();
}

std::vector<SegmentInfo> segment_snapshot(c10::DeviceIndex device) {
  std::vector<SegmentInfo> out;
  for (const auto& card : g_allocator.cards()) {
    if (device < 0 || card->device() == device) {
      std::vector<SegmentInfo> segments = card->snapshot();
      out.insert(out.end(), std::make_move_iterator(segments.begin()), std::make_move_iterator(segments.end()));
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
