// The caching allocator's state, shared by its two halves and by nothing else:
// caching_allocator.cpp (the blocks the card counts: statistics, history, settings, snapshots)
// and provisional_blocks.cpp (an operator kernel's allocations, counted only once handed back as
// results). One mutex guards all of it.
#pragma once

#include "card_memory.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>

#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torch {
struct CapturedTraceback;
}

namespace supa::allocator_state {

using Stack = std::shared_ptr<torch::CapturedTraceback>;

// A card and the statistics PyTorch keeps for it.
struct DeviceMemory {
  DeviceMemory(c10::DeviceIndex device, int64_t capacity, Backing backing);
  CardMemory card;
  c10::CachingDeviceAllocator::DeviceStats stats;
  // Freed blocks that streams they were recorded on have not reached yet, with the time they will
  // (stream_timeline.h): still active, not yet reusable.
  std::vector<std::pair<CardBlock*, int64_t>> pending_free;
  // Graph captures under way on the card (notify_capture_begin), and the blocks freed during them
  // that other streams used: each with the points placed on those streams at its free
  // (capture_order.h; graph_capture_record_stream_reuse), or none: held until no graph captures.
  int captures_underway = 0;
  struct CaptureFree {
    CardBlock* block;
    std::vector<std::pair<c10::StreamId, uint64_t>> points;
  };
  std::vector<CaptureFree> capture_frees;
};

extern std::mutex g_mutex;
extern std::vector<std::unique_ptr<DeviceMemory>> g_devices;
extern std::unordered_map<void*, CardBlock*> g_blocks;  // the allocated blocks, by address
extern BlockPolicy g_policy;                            // `_set_allocator_settings`

// The rest under g_mutex unless said otherwise.
DeviceMemory& memory_of(c10::DeviceIndex device);
[[noreturn]] void raise_host_oom(DeviceMemory& mem, c10::DeviceIndex device, size_t size, int error);
// The block size that serves a request; raises for a request of 1 EiB or more, as CUDA does.
size_t block_size(size_t nbytes, c10::DeviceIndex device);
// A statistic moves in "all" and in the pool (small or large) of the block or segment; count
// statistics (allocation, segment, active) by one per block.
void update(c10::CachingDeviceAllocator::StatArray& stat, bool small, int64_t amount);
void update(c10::CachingDeviceAllocator::StatArray& stat, bool small, size_t size, bool increase);
void count_block(c10::CachingDeviceAllocator::StatArray& stat, bool small, bool increase);
// The free blocks of split segments ("inactive_split"), as the card reports their change.
void count_inactive_split(c10::CachingDeviceAllocator::DeviceStats& stats, bool small, int blocks, int64_t bytes);
// Counts a block the card handed out for a request of `nbytes` as allocated (`split_counted`: the
// free blocks' change was counted when it was handed out, as a taken block's is).
CardBlock* count_placed(DeviceMemory& mem, c10::DeviceIndex device, const Placement& placed, size_t nbytes,
                        const Stack& stack, bool split_counted = false);
// A block for a request of `nbytes` on `stream`, counted as allocated.
CardBlock* place_block(DeviceMemory& mem, c10::DeviceIndex device, size_t nbytes, const c10::MempoolId_t& pool,
                       c10::StreamId stream, const Stack& stack);
// A block handed out or returned, for the GPU trace (without g_mutex).
void report_block(void* ptr, bool allocated);

}  // namespace supa::allocator_state
