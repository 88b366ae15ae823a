// Reports to PyTorch's GPU trace. Once a tool turns the trace on (the stream sanitizer, or a
// callback registered for what only the native runtime sees), the device guard and the allocator
// report to `torch.supa._gpu_trace`, as CUDA's do; until then this is one load of a flag.
#pragma once

#include <c10/core/impl/GPUTrace.h>

namespace supa {

inline const c10::impl::PyInterpreter* gpu_trace() {
  return c10::impl::GPUTrace::get_trace();
}

// Held around a report: a Python error pending on this thread (an operator's error being raised
// while its temporaries are freed) survives the callbacks instead of becoming a SystemError.
// Defined in gpu_trace.cpp, which compiles with the bindings (it needs Python.h).
class PendingPythonErrorKept {
 public:
  PendingPythonErrorKept();
  ~PendingPythonErrorKept();
  PendingPythonErrorKept(const PendingPythonErrorKept&) = delete;
  PendingPythonErrorKept& operator=(const PendingPythonErrorKept&) = delete;

 private:
  bool held_ = false;
  int gil_state_ = 0;
  void* error_[3] = {nullptr, nullptr, nullptr};
};

// Runs `report(trace)` when the trace is on, keeping a pending Python error: every report to the
// GPU trace goes through here.
template <typename Report>
void report_to_gpu_trace(Report&& report) {
  if (const auto* trace = gpu_trace()) {
    PendingPythonErrorKept keep;
    report(*trace);
  }
}

}  // namespace supa
