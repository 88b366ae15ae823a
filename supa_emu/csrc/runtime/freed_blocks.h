// When a freed block may serve again, the caching allocator's other half beside caching_allocator.cpp
// (its state is allocator_state.h's, under g_mutex): at once; once the streams it was recorded on
// have passed its free (record_stream), as a card's allocator waits for events recorded on them;
// or, for one freed during a graph capture after use on other streams, once no graph captures, or
// (graph_capture_record_stream_reuse) once the capture's stream order puts its stream after those
// uses (capture_order.h), as on CUDA, where the events that would tell cannot be queried during
// capture.
#pragma once

#include "allocator_state.h"

#include <c10/core/Stream.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace supa {

// A graph begins (ends) capturing `stream` on `device` (graph.cpp), as CUDA's graphs tell their
// allocator.
void notify_capture_begin(c10::DeviceIndex device, c10::StreamId stream);
void notify_capture_ended(c10::DeviceIndex device);

namespace allocator_state {

// A freed block leaves the active count and returns to the card's cache.
void return_to_cache(DeviceMemory& mem, CardBlock* block);
// Returns the pending blocks whose streams have passed their free to the cache; `wait`: first
// waits until every one has (a synchronisation of the card's streams).
void settle_pending_frees(DeviceMemory& mem, bool wait);
// A freed block that other streams used is reused only once they have reached the free.
void release_after_uses(DeviceMemory& mem, c10::DeviceIndex device, CardBlock* block);
void set_capture_record_stream_reuse(bool on);
// For a block freed during capture that other streams used: a point placed now on each of them,
// or none (the block then waits for the end of the capture).
std::vector<std::pair<c10::StreamId, uint64_t>> capture_free_points(c10::DeviceIndex device, const CardBlock& block);
// Before a request on `stream`: the blocks freed during capture that may serve it again do.
void settle_capture_frees(DeviceMemory& mem, c10::DeviceIndex device, c10::StreamId stream);

}  // namespace allocator_state
}  // namespace supa
