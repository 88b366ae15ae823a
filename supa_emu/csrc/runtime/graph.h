// Graph capture for `supa`: calls recorded while capturing, run again on replay.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>

#include <string>
#include <vector>

namespace supa {

// True when the current stream (of this thread, on the capture's device) is being captured: the
// capturing stream, or one that joined the capture by waiting on its events (capture_order.h).
bool is_capturing();
// True when `stream` on `device` is being captured (the capturing stream or one that joined it).
bool is_stream_captured(c10::DeviceIndex device, c10::StreamId stream);
// The pool of the graph capturing the current stream; {0, 0} when it is not captured.
c10::MempoolId_t capture_pool();
// True on the thread that replays a graph, while it runs the recorded calls again.
bool is_replaying();
// Called by kernels while capturing: remembers the call so that replay can run it again.
void record_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                 const std::vector<c10::IValue>& outputs);
// Under capture of `stream`, `_sleep`'s time is a launch of the graph: recorded, queued on the
// replaying stream at each replay, not on the capturing one. False (nothing recorded) otherwise.
bool record_stream_work_in_capture(c10::DeviceIndex device, c10::StreamId stream, int64_t ns);
// What a card refuses while a stream captures (the host waiting on the stream, pageable copies):
// raises its error and invalidates the capture, whose capture_end() then raises too.
[[noreturn]] void refuse_during_capture(const std::string& what);
// A call's arguments with their lists copied, to run the call again: a call through the fallback
// replaces the tensors of its lists in place.
std::vector<c10::IValue> with_own_lists(c10::ArrayRef<c10::IValue> arguments);
// Keeps `generator` graph-safe in the graph now capturing (SUPAGraph.register_generator_state).
void register_generator_with_capture(const at::Generator& generator);
void register_graph_impl();

}  // namespace supa
