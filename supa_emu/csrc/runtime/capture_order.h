// The order among a device's streams while a graph captures, as the captured graph on a card
// orders its nodes: a stream that waits on an event comes after every point the recording stream
// had reached (itself or through its own waits) when the event was recorded.
//
// The caching allocator asks it when a block freed during capture that other streams used
// (record_stream) may serve the capture again (graph_capture_record_stream_reuse): at the free it
// places a point on each of those streams, and the block serves its own stream again once that
// stream has waited for all of them. CUDA's allocator asks the same of the graph: whether the
// last nodes of those streams at the free precede every last node of the allocating stream. The
// emulator does not see the work queued on streams other than the capturing one (they run
// eagerly), so the point is the free itself: the wait must be on an event recorded after the
// free, where a card's graph also accepts an event recorded after the stream's last work before
// it. The two agree whenever the stream did work between its last event and the free.
//
// A stream belongs to the capture once it has waited on an event of a stream that does (the
// capturing stream from the start), as a stream joins a card's capture. Nothing is tracked while
// no graph captures on the device: events then carry nothing.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <map>
#include <memory>

namespace supa {

// What an event carries: the points its stream had reached when it was recorded.
struct CapturePoints {
  c10::DeviceIndex device;
  uint64_t capture;  // which capture of the device (points of an ended capture mean nothing)
  std::map<c10::StreamId, uint64_t> reached;  // by stream: its last point reached
};
using CapturePointsPtr = std::shared_ptr<const CapturePoints>;

// A graph begins (ends) capturing `stream` on `device`.
void capture_order_begin(c10::DeviceIndex device, c10::StreamId stream);
void capture_order_end(c10::DeviceIndex device);
// For an event recorded now on `stream`, and a wait on such an event: null (nothing to carry)
// when the stream is not in a capture.
CapturePointsPtr capture_points_at_record(c10::DeviceIndex device, c10::StreamId stream);
void capture_order_wait(c10::DeviceIndex device, c10::StreamId stream, const CapturePointsPtr& points);
// Whether `stream` belongs to the capture on `device`.
bool capture_order_joined(c10::DeviceIndex device, c10::StreamId stream);
// Places a new point on `stream`, after everything it has reached; returns it.
uint64_t capture_order_mark(c10::DeviceIndex device, c10::StreamId stream);
// Whether `stream` has waited for point `point` of `other`.
bool capture_order_reached(c10::DeviceIndex device, c10::StreamId stream, c10::StreamId other, uint64_t point);

}  // namespace supa
