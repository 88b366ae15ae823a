// Graph capture for `supa`: calls recorded while capturing, run again on replay.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace supa {

bool is_capturing();
// True on the thread that replays a graph, while it runs the recorded calls again.
bool is_replaying();
// Called by kernels while capturing: remembers the call so that replay can run it again.
void record_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                 const std::vector<c10::IValue>& outputs);
// Keeps `generator` graph-safe in the graph now capturing (SUPAGraph.register_generator_state).
void register_generator_with_capture(const at::Generator& generator);
void register_graph_impl();

}  // namespace supa
