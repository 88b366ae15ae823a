// The operator stream the planner's time model reads: every operator a rank dispatches on the
// card, in dispatch order, with its operands' shapes and dtypes and the stream it was issued on,
// interleaved with the event records, event waits and synchronisations of the program's streams
// and with marks the Python side sets (collectives, step ends).
//
// Operators are seen through a global RecordFunction callback (the dispatcher's observer hook, the
// one the profiler uses), installed only when the planner asks. An operator is a launch when it has
// a supa operand (or a supa device argument) and runs a supa kernel: a kernel registered for supa,
// or the boxed fallback; an operator that decomposes into others (a composite without a supa
// kernel: linear, matmul, dropout) is not recorded itself, its parts are. What a launch calls in
// turn (CPU kernels on host views, shape rules, allocations) is not recorded: that is the kernel.
// Nor is an operator on a tensor subclass that dispatches in Python (DTensor: its sizes are the
// global ones): the operators it calls on its plain tensors are the launches.
// The same launches, timed by the host, feed torch.profiler's card track while a profile records
// (card_time_profiler.cpp), through a callback of their own.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <string>
#include <vector>

namespace supa {

enum class TraceKind : int64_t {
  kOp = 0,
  kEventRecord = 1,  // aux: the event; on `stream`
  kEventWait = 2,    // aux: the event; `stream` waits for it
  kStreamSync = 3,   // the host waits for `stream`
  kEventSync = 4,    // the host waits for the event `aux`
  kDeviceSync = 5,   // the host waits for every stream of `device`
  kMark = 6,         // aux: a value the Python side gave (collective, step end)
};

// Argument encoding of an entry's `args`, a flat list of tokens:
//   kTensor dtype device_type ndim sizes...   (device_type: 0 CPU, 1 supa, 2 other)
//   kInt v | kDouble bits | kBool v | kNone | kIntList n v... | kList n items... | kDevice type | kOther
//   kOutputs: the operator's results follow.
enum ArgTag : int64_t { kTensor = 0, kInt, kDouble, kBool, kNone, kIntList, kList, kDevice, kOther, kOutputs };

struct TraceEntry {
  TraceKind kind;
  int64_t name;  // index into op_trace_names() (operators only)
  c10::DeviceIndex device;
  c10::StreamId stream;
  int64_t aux;  // operators: the card's allocated bytes after the launch
  std::vector<int64_t> args;
};

// Starts recording (installs the callback once); stop keeps the callback installed but idle.
void op_trace_set_enabled(bool on);
bool op_trace_enabled();
// While paused on this thread (counted), nothing dispatched here is recorded: the planner's own work.
void op_trace_pause(bool paused);
void op_trace_event(TraceKind kind, uintptr_t event, c10::DeviceIndex device, c10::StreamId stream);
// A mark on the current stream of the current device.
void op_trace_mark(int64_t value);
// The entries recorded since the last take, handed over.
std::vector<TraceEntry> op_trace_take();
// "aten::name.overload" per name index.
std::vector<std::string> op_trace_names();

// The profiler's card track (card_time_profiler.cpp): while a profile records, each launch is
// also kept with the profiler's correlation id of the operator that made it and the host's times.
struct ProfiledLaunch {
  int64_t name;  // index into op_trace_names()
  c10::DeviceIndex device;
  c10::StreamId stream;
  uint64_t correlation;  // 0: made outside any operator the profiler saw
  int64_t host_start_ns;  // c10::getTime() when the host began the operator
  int64_t host_end_ns;
  std::vector<int64_t> args;  // as TraceEntry::args
};
void op_trace_set_profiling(bool on);
// The profiler's correlation ids of the operators running on this thread (it pushes one as an
// operator starts and pops it as it ends).
void op_trace_push_correlation(uint64_t id);
void op_trace_pop_correlation();
std::vector<ProfiledLaunch> op_trace_take_profiled();

}  // namespace supa
