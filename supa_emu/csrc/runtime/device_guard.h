// The device guard PyTorch uses for `supa` (current device, streams, events), registered
// statically; what else the runtime needs to know about streams.
#pragma once

#include <c10/core/Stream.h>

namespace supa {

// A stream's priority is encoded in its id (as CUDA encodes it), so no table is kept.
int stream_priority(c10::StreamId id);
// This thread's current stream on `device` (0: the default stream).
c10::StreamId current_stream_id(c10::DeviceIndex device);

}  // namespace supa
