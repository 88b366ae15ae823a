// Graph capture for `supa`: calls recorded while capturing, run again on replay.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace supa {

bool is_capturing();
// True on the thread that replays a graph, while it runs the recorded calls again.
bool is_replaying();
// Called by kernels while capturing: remembers the call so that replay can run it again.
void record_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                 const std::vector<c10::IValue>& outputs);
void register_graph_impl();

}  // namespace supa
