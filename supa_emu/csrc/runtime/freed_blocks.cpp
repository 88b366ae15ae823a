// The freed blocks' way back to the cache (freed_blocks.h): CardAllocator's members for it, run
// under the card's lock.
#include "freed_blocks.h"

#include "capture_order.h"
#include "stream_timeline.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace supa {

// Returns the pending blocks whose streams have passed their free to the cache; `wait`: first
// waits until every one has (a synchronisation of the card's streams).
void CardAllocator::settle_pending_frees(bool wait) {
  auto& pending = pending_free_;
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
    return_to_cache(block);
  }
}

// A freed block that other streams used (record_stream) is reused only once they have reached
// the free, as a card's allocator waits for events recorded on them.
void CardAllocator::release_after_uses(CardBlock* block) {
  int64_t ready = 0;
  for (int64_t used_on : block->used_on) {
    ready = std::max(ready, stream_ready_ns(device_, used_on));
  }
  if (ready > 0 && ready > now_ns()) {  // (no clock read for a block no other stream used)
    pending_free_.emplace_back(block, ready);
  } else {
    return_to_cache(block);
  }
}

// For a block freed during capture that other streams used: a point placed now on each of them
// (capture_order.h), or none, and the block waits for the end of the capture, when the option is
// off or a stream it was used on (or its own) is not in the capture, as on CUDA.
std::vector<std::pair<c10::StreamId, uint64_t>> CardAllocator::capture_free_points(const CardBlock& block) {
  std::vector<std::pair<c10::StreamId, uint64_t>> points;
  if (!capture_record_stream_reuse_ || !capture_order_joined(device_, block.stream)) {
    return points;
  }
  for (int64_t used_on : block.used_on) {
    if (!capture_order_joined(device_, used_on)) {
      return points;
    }
  }
  for (int64_t used_on : block.used_on) {
    points.emplace_back(used_on, capture_order_mark(device_, used_on));
  }
  return points;
}

// Before a request on `stream`: once no graph captures, the blocks freed during capture go the
// way of any freed block; while one does (and the option is on), those of `stream` that it has
// waited past on every stream they were used on serve it again.
void CardAllocator::settle_capture_frees(c10::StreamId stream) {
  auto& frees = capture_frees_;
  if (frees.empty()) {
    return;
  }
  if (captures_underway_ == 0) {
    const auto held = std::move(frees);
    frees.clear();
    for (const auto& free : held) {
      release_after_uses(free.block);
    }
    return;
  }
  if (!capture_record_stream_reuse_) {
    return;
  }
  const auto reusable = [&](const CaptureFree& free) {
    return free.block->stream == stream && !free.points.empty() &&
           std::all_of(free.points.begin(), free.points.end(), [&](const auto& point) {
             return capture_order_reached(device_, stream, point.first, point.second);
           });
  };
  auto kept = std::stable_partition(frees.begin(), frees.end(), [&](const auto& free) { return !reusable(free); });
  std::vector<CaptureFree> done(kept, frees.end());
  frees.erase(kept, frees.end());
  for (const auto& free : done) {
    free.block->used_on.clear();  // the capture orders its reuse after those streams' uses
    return_to_cache(free.block);
  }
}

void CardAllocator::capture_begin(c10::StreamId stream) {
  std::lock_guard<LightMutex> lock(mutex_);
  captures_underway_++;
  capture_order_begin(device_, stream);
}

void CardAllocator::capture_ended() {
  std::lock_guard<LightMutex> lock(mutex_);
  if (captures_underway_ > 0 && --captures_underway_ == 0) {
    capture_order_end(device_);
  }
}

void notify_capture_begin(c10::DeviceIndex device, c10::StreamId stream) {
  card_allocator(device).capture_begin(stream);
}

void notify_capture_ended(c10::DeviceIndex device) {
  card_allocator(device).capture_ended();
}

}  // namespace supa
