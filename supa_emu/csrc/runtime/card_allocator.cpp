// One card's caching allocator (card_allocator.h): counted blocks, statistics, settings and
// snapshots, with the statistics of PyTorch's CUDA caching allocator (inactive_split for the free
// blocks of split segments, whole blocks in allocated_bytes).
#include "card_allocator.h"

#include "devices.h"
#include "mem_pool.h"
#include "memory_history.h"
#include "out_of_memory.h"

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace supa {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingDeviceAllocator::DeviceStats;

// A statistic moves in "all" and in the pool (small or large) of the block or segment (written
// out, not looped, and inlined: every allocation and free moves a dozen of them).
C10_ALWAYS_INLINE void update(StatArray& stat, bool small, int64_t amount) {
  Stat& pool = stat[small ? 1 : 2];
  if (amount > 0) {
    stat[0].increase(static_cast<size_t>(amount));
    pool.increase(static_cast<size_t>(amount));
  } else if (amount < 0) {  // 0 moves nothing (not even a peak)
    stat[0].decrease(static_cast<size_t>(-amount));
    pool.decrease(static_cast<size_t>(-amount));
  }
}

C10_ALWAYS_INLINE void update(StatArray& stat, bool small, size_t size, bool increase) {
  update(stat, small, increase ? static_cast<int64_t>(size) : -static_cast<int64_t>(size));
}

// Count statistics (allocation, segment, active) move by one per block.
C10_ALWAYS_INLINE void count_block(StatArray& stat, bool small, bool increase) {
  update(stat, small, increase ? 1 : -1);
}

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

}  // namespace

CardAllocator::CardAllocator(c10::DeviceIndex device, int64_t capacity, Backing backing, BlockTable& table)
    : device_(device),
      device_as_c10_(kSupa, device),
      table_(table),
      card_(
          device, capacity, [this](const CardSegment& segment) { segment_released(segment); }, backing,
          {[](const PoolId& pool) { return pool_use_count(pool) > 0; }, &pool_use_on_oom, &pool_no_split}) {
  stats_.max_split_size = policy_.max_split_size;
  card_.set_pages_changed([this](const CardSegment& segment, void* ptr, size_t size, bool mapped) {
    pages_changed(segment, ptr, size, mapped);
  });
}

// Pages of an expandable segment mapped or unmapped (called by the card): reserved memory and the
// device's allocations and frees, never segments, as CUDA counts them.
void CardAllocator::pages_changed(const CardSegment& segment, void* ptr, size_t size, bool mapped) {
  record_memory_event(mapped ? "segment_map" : "segment_unmap", device_, ptr, size,
                      mapped && placing_ != nullptr ? *placing_ : nullptr, size, segment.stream);
  update(stats_.reserved_bytes, segment.small, size, mapped);
  ++(mapped ? stats_.num_device_alloc : stats_.num_device_free);
}

// A segment the card gives back to the host (called by the card).
void CardAllocator::segment_released(const CardSegment& segment) {
  record_memory_event("segment_free", device_, segment.ptr, segment.size, nullptr, segment.size, segment.stream);
  count_block(stats_.segment, segment.small, false);
  update(stats_.reserved_bytes, segment.small, segment.size, false);
  if (segment.oversize) {
    stats_.oversize_segments.decrease(1);
  }
  stats_.num_device_free++;
}

// `stack`: the request's, kept with the history's "oom" event (the planner reports where it failed).
void CardAllocator::raise_oom(size_t size, const Stack& stack) {
  stats_.num_ooms++;
  record_memory_event("oom", device_, nullptr, size, stack);
  throw_card_oom(card_, device_, size, stats_.allocated_bytes[0].current);
}

void CardAllocator::raise_host_oom(size_t size, int error) {
  stats_.num_ooms++;
  throw_host_oom(card_, device_, size, error);
}

void CardAllocator::count_inactive_split(bool small, int blocks, int64_t bytes) {
  update(stats_.inactive_split, small, blocks);
  update(stats_.inactive_split_bytes, small, bytes);
}

CardBlock* CardAllocator::count_placed(const Placement& placed, size_t nbytes, const Stack& stack,
                                       bool split_counted, bool in_table) {
  CardBlock* block = placed.block;
  const bool small = block->small;
  if (const CardSegment* segment = placed.segment) {
    record_memory_event("segment_alloc", device_, segment->ptr, segment->size, stack, segment->size, segment->stream);
    stats_.num_device_alloc++;
    count_block(stats_.segment, small, true);
    update(stats_.reserved_bytes, small, segment->size, true);
    if (segment->oversize) {
      stats_.oversize_segments.increase(1);
    }
  }
  if (!split_counted) {
    count_inactive_split(small, placed.inactive_split, placed.inactive_split_bytes);
  }
  block->allocated = true;
  block->requested = nbytes;
  if (!in_table) {
    table_.add_block(block);
  }
  count_block(stats_.allocation, small, true);
  count_block(stats_.active, small, true);
  update(stats_.allocated_bytes, small, block->size, true);
  update(stats_.active_bytes, small, block->size, true);
  update(stats_.requested_bytes, small, nbytes, true);
  if (block->oversize) {
    stats_.oversize_allocations.increase(1);
  }
  record_memory_event("alloc", device_, block->ptr, nbytes, stack, block->size, block->stream);
  // As CUDA's allocator: the profiler's memory view (profile_memory=True) sees each block.
  c10::reportMemoryUsageToProfiler(block->ptr, static_cast<int64_t>(block->size), stats_.allocated_bytes[0].current,
                                   stats_.reserved_bytes[0].current, device_as_c10_);
  return block;
}

// A freed block leaves the active count and returns to the card's cache.
void CardAllocator::return_to_cache(CardBlock* block) {
  const bool small = block->small;
  count_block(stats_.active, small, false);
  update(stats_.active_bytes, small, block->size, false);
  block->used_on.clear();
  const Release changed = card_.cache(block);  // may merge `block` away
  count_inactive_split(small, changed.inactive_split, changed.inactive_split_bytes);
}

CardBlock* CardAllocator::place_block(size_t nbytes, const PoolId& pool, c10::StreamId stream, const Stack& stack) {
  const size_t size = policy_.round_size(nbytes);
  placing_ = &stack;
  const Placement placed = card_.place(size, pool, policy_, stream);
  placing_ = nullptr;
  stats_.num_alloc_retries += placed.retries;
  if (placed.block == nullptr) {
    if (placed.host_error != 0) {
      raise_host_oom(size, placed.host_error);
    }
    raise_oom(size, stack);
  }
  return count_placed(placed, nbytes, stack);
}

CardBlock* CardAllocator::allocate(size_t nbytes, const PoolId& pool, c10::StreamId stream, const Stack& stack) {
  std::lock_guard<LightMutex> lock(mutex_);
  settle_capture_frees(stream);
  settle_pending_frees(/*wait=*/false);
  return place_block(nbytes, pool, stream, stack);
}

void CardAllocator::free(CardBlock* block, const Stack& stack) {
  std::lock_guard<LightMutex> lock(mutex_);
  const bool small = block->small;
  count_block(stats_.allocation, small, false);
  update(stats_.allocated_bytes, small, block->size, false);
  update(stats_.requested_bytes, small, block->requested, false);
  if (block->oversize) {
    stats_.oversize_allocations.decrease(1);
  }
  // The history names what was asked for, as the card's does; the statistics count whole blocks.
  void* const ptr = block->ptr;
  const size_t size = block->size, requested = block->requested;
  const int64_t stream = block->stream;
  const bool events = memory_events_wanted();
  if (events) {
    record_memory_event("free_requested", device_, ptr, requested, stack, size, stream);
  }
  c10::reportMemoryUsageToProfiler(ptr, -static_cast<int64_t>(size), stats_.allocated_bytes[0].current,
                                   stats_.reserved_bytes[0].current, device_as_c10_);
  if (!block->used_on.empty() && captures_underway_ > 0) {
    capture_frees_.push_back({block, capture_free_points(*block)});
  } else {
    release_after_uses(block);
  }
  if (events) {
    record_memory_event("free_completed", device_, ptr, requested, stack, size, stream);
  }
}

void CardAllocator::record_stream(CardBlock* block, c10::StreamId stream) {
  std::lock_guard<LightMutex> lock(mutex_);
  if (stream != block->stream && std::find(block->used_on.begin(), block->used_on.end(), stream) == block->used_on.end()) {
    block->used_on.push_back(stream);
  }
}

void CardAllocator::empty_cache(const PoolId* pool, bool wait_for_streams) {
  std::lock_guard<LightMutex> lock(mutex_);
  if (wait_for_streams) {
    // As a card's allocator: wait for every stream's use of freed blocks, then release.
    ++stats_.num_sync_all_streams;
    settle_pending_frees(/*wait=*/true);
  }
  card_.release_cached(pool);
}

void CardAllocator::set_policy(const BlockPolicy& policy, bool capture_record_stream_reuse) {
  std::lock_guard<LightMutex> lock(mutex_);
  // Blocks keep the oversize status they were created with, so the counters stay balanced.
  policy_ = policy;
  capture_record_stream_reuse_ = capture_record_stream_reuse;
  stats_.max_split_size = policy_.max_split_size;
}

c10::CachingDeviceAllocator::DeviceStats CardAllocator::stats() {
  std::lock_guard<LightMutex> lock(mutex_);
  return stats_;
}

void CardAllocator::reset_accumulated_stats() {
  std::lock_guard<LightMutex> lock(mutex_);
  for_each_stat(stats_, [](Stat& stat) { stat.reset_accumulated(); });
  stats_.num_alloc_retries = 0;
  stats_.num_ooms = 0;
  stats_.num_sync_all_streams = 0;
  stats_.num_device_alloc = 0;
  stats_.num_device_free = 0;
}

void CardAllocator::reset_peak_stats() {
  std::lock_guard<LightMutex> lock(mutex_);
  for_each_stat(stats_, [](Stat& stat) { stat.reset_peak(); });
}

std::pair<size_t, size_t> CardAllocator::memory_info() {
  std::lock_guard<LightMutex> lock(mutex_);
  return {static_cast<size_t>(card_.unreserved()), static_cast<size_t>(card_.capacity())};
}

void CardAllocator::set_fraction(double fraction) {
  std::lock_guard<LightMutex> lock(mutex_);
  card_.set_fraction(fraction);
}

double CardAllocator::fraction() {
  std::lock_guard<LightMutex> lock(mutex_);
  return card_.fraction();
}

bool CardAllocator::holds(const void* ptr) {
  std::lock_guard<LightMutex> lock(mutex_);
  return card_.segment_of(ptr) != nullptr;
}

std::vector<SegmentInfo> CardAllocator::snapshot() {
  std::lock_guard<LightMutex> lock(mutex_);
  std::vector<SegmentInfo> out;
  for (const auto& entry : card_.segments()) {
    const CardSegment& segment = *entry.second;
    // An expandable segment shows one segment per contiguous mapped range, as CUDA's snapshot does.
    SegmentInfo* info = nullptr;
    for (const CardBlock* b : card_.blocks_of(segment)) {
      if (!b->mapped) {
        info = nullptr;
        continue;
      }
      if (info == nullptr) {
        out.push_back({segment.device, reinterpret_cast<uintptr_t>(b->ptr), 0, 0, 0, 0, segment.small, segment.pool,
                       segment.stream, {}, segment.expandable()});
        info = &out.back();
      }
      // The card holds a freed block until the streams that used it pass the free: active, not
      // allocated (as a block an operator kernel took and has not handed back).
      const bool allocated = b->allocated && table_.find_block(b->ptr) == b;
      info->blocks.push_back({reinterpret_cast<uintptr_t>(b->ptr), b->size, b->requested, allocated, b->allocated});
      info->total_size += b->size;
      if (allocated) {
        info->allocated_size += b->size;
        info->requested_size += b->requested;
      }
      if (b->allocated) {
        info->active_size += b->size;
      }
    }
  }
  return out;
}

}  // namespace supa
