// When the work queued on each stream completes on the emulated card.
//
// Kernels run synchronously on the host, so a stream is idle once its last call returned; only
// `_sleep` queues time that runs past the call. This is the one record of that time: the device
// guard answers stream and event queries and synchronisations from it, and event waits carry it
// from one stream to another, as a card's streams and events would.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>

namespace supa {

// Monotonic host time in nanoseconds, the clock of every ready time below.
int64_t now_ns();
// Queues `ns` nanoseconds of work on the stream, after the work queued on it so far.
void queue_stream_work(c10::DeviceIndex device, c10::StreamId stream, int64_t ns);
// When the work queued so far on the stream completes; at most now_ns() for an idle stream.
int64_t stream_ready_ns(c10::DeviceIndex device, c10::StreamId stream);
// Work queued later on the stream starts no earlier than `ready_ns` (a wait on an event).
void stream_wait_until(c10::DeviceIndex device, c10::StreamId stream, int64_t ready_ns);
// When the work queued so far on every stream of the device completes.
int64_t device_ready_ns(c10::DeviceIndex device);
// Blocks the calling thread until now_ns() >= ready_ns.
void wait_until_ns(int64_t ready_ns);

}  // namespace supa
