// The freed blocks' way back to the cache (freed_blocks.h).
#include "freed_blocks.h"

#include "capture_order.h"
#include "stream_timeline.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace supa {
namespace allocator_state {

// A freed block leaves the active count and returns to the card's cache (under g_mutex).
void return_to_cache(DeviceMemory& mem, CardBlock* block) {
  const bool small = block->small;
  count_block(mem.stats.active, small, false);
  update(mem.stats.active_bytes, small, block->size, false);
  block->used_on.clear();
  const Release changed = mem.card.cache(block);  // may merge `block` away
  count_inactive_split(mem.stats, small, changed.inactive_split, changed.inactive_split_bytes);
}

// Returns the pending blocks whose streams have passed their free to the cache (under g_mutex);
// `wait`: first waits until every one has (a synchronisation of the card's streams).
void settle_pending_frees(DeviceMemory& mem, bool wait) {
  auto& pending = mem.pending_free;
  if (pending.empty()) {
    return;
  }
  if (wait) {
    int64_t last = 0;
    for (const auto& [block, ready] : pending) {
      last = std::max(last, ready);
    }
    wait_until_ns(last);
  }
  const int64_t now = now_ns();
  auto reached = std::stable_partition(pending.begin(), pending.end(),
                                       [now](const auto& entry) { return entry.second > now; });
  std::vector<std::pair<CardBlock*, int64_t>> done(reached, pending.end());
  pending.erase(reached, pending.end());
  for (const auto& [block, ready] : done) {
    return_to_cache(mem, block);
  }
}

// A freed block that other streams used (record_stream) is reused only once they have reached
// the free, as a card's allocator waits for events recorded on them (under g_mutex).
void release_after_uses(DeviceMemory& mem, c10::DeviceIndex device, CardBlock* block) {
  int64_t ready = 0;
  for (int64_t used_on : block->used_on) {
    ready = std::max(ready, stream_ready_ns(device, used_on));
  }
  if (ready > now_ns()) {
    mem.pending_free.emplace_back(block, ready);
  } else {
    return_to_cache(mem, block);
  }
}

namespace {

bool g_capture_record_stream_reuse = false;  // graph_capture_record_stream_reuse (under g_mutex)

}  // namespace

void set_capture_record_stream_reuse(bool on) {
  g_capture_record_stream_reuse = on;
}

// For a block freed during capture that other streams used: a point placed now on each of them
// (capture_order.h), or none, and the block waits for the end of the capture, when the option is
// off or a stream it was used on (or its own) is not in the capture, as on CUDA (under g_mutex).
std::vector<std::pair<c10::StreamId, uint64_t>> capture_free_points(c10::DeviceIndex device, const CardBlock& block) {
  std::vector<std::pair<c10::StreamId, uint64_t>> points;
  if (!g_capture_record_stream_reuse || !capture_order_joined(device, block.stream)) {
    return points;
  }
  for (int64_t used_on : block.used_on) {
    if (!capture_order_joined(device, used_on)) {
      return points;
    }
  }
  for (int64_t used_on : block.used_on) {
    points.emplace_back(used_on, capture_order_mark(device, used_on));
  }
  return points;
}

// Before a request on `stream`: once no graph captures, the blocks freed during capture go the
// way of any freed block; while one does (and the option is on), those of `stream` that it has
// waited past on every stream they were used on serve it again (under g_mutex).
void settle_capture_frees(DeviceMemory& mem, c10::DeviceIndex device, c10::StreamId stream) {
  auto& frees = mem.capture_frees;
  if (frees.empty()) {
    return;
  }
  if (mem.captures_underway == 0) {
    const auto held = std::move(frees);
    frees.clear();
    for (const auto& free : held) {
      release_after_uses(mem, device, free.block);
    }
    return;
  }
  if (!g_capture_record_stream_reuse) {
    return;
  }
  const auto reusable = [&](const DeviceMemory::CaptureFree& free) {
    return free.block->stream == stream && !free.points.empty() &&
           std::all_of(free.points.begin(), free.points.end(), [&](const auto& point) {
             return capture_order_reached(device, stream, point.first, point.second);
           });
  };
  auto kept = std::stable_partition(frees.begin(), frees.end(), [&](const auto& free) { return !reusable(free); });
  std::vector<DeviceMemory::CaptureFree> done(kept, frees.end());
  frees.erase(kept, frees.end());
  for (const auto& free : done) {
    free.block->used_on.clear();  // the capture orders its reuse after those streams' uses
    return_to_cache(mem, free.block);
  }
}

}  // namespace allocator_state

void notify_capture_begin(c10::DeviceIndex device, c10::StreamId stream) {
  using namespace allocator_state;
  std::lock_guard<std::mutex> lock(g_mutex);
  memory_of(device).captures_underway++;
  capture_order_begin(device, stream);
}

void notify_capture_ended(c10::DeviceIndex device) {
  using namespace allocator_state;
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceMemory& mem = memory_of(device);
  if (mem.captures_underway > 0 && --mem.captures_underway == 0) {
    capture_order_end(device);
  }
}

}  // namespace supa
