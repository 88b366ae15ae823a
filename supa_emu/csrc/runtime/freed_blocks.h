// When a freed block may serve again, one card's allocator's concern (card_allocator.h; its members
// are in freed_blocks.cpp): at once; once the streams it was recorded on have passed its free
// (record_stream), as a card's allocator waits for events recorded on them; or, for one freed
// during a graph capture after use on other streams, once no graph captures, or
// (graph_capture_record_stream_reuse) once the capture's stream order puts its stream after those
// uses (capture_order.h), as on CUDA, where the events that would tell cannot be queried during
// capture.
#pragma once

#include "card_allocator.h"

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace supa {

// A graph begins (ends) capturing `stream` on `device` (graph.cpp), as CUDA's graphs tell their
// allocator.
void notify_capture_begin(c10::DeviceIndex device, c10::StreamId stream);
void notify_capture_ended(c10::DeviceIndex device);

}  // namespace supa
