// Graph replays launched on busy streams wait here, and run concurrently (kernel by kernel, one
// kernel of each stream in turn) at the first point that observes card memory or orders work:
// see docs/device_model.md#replays-on-busy-streams-run-concurrently.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <memory>

namespace supa {

// One replay waiting on a stream.
class QueuedReplay {
 public:
  virtual ~QueuedReplay() = default;
  // Runs the replay's next kernel; false when none was left.
  virtual bool run_next() = 0;
};

// While it lives, this thread's observation points leave the queued replays waiting: the thread
// runs them (their own kernels observe memory too) or runs a replay at once (the replays queued
// meanwhile by other threads wait for its next observation point).
class RunningReplaysScope {
 public:
  RunningReplaysScope();
  ~RunningReplaysScope();
  RunningReplaysScope(const RunningReplaysScope&) = delete;
  RunningReplaysScope& operator=(const RunningReplaysScope&) = delete;

 private:
  bool previous_;
};

// True when replays wait or run (a new replay then waits behind them).
bool replays_pending();
// Queues `replay` on the stream, after the replays queued on it so far.
void queue_replay(c10::DeviceIndex device, c10::StreamId stream, std::unique_ptr<QueuedReplay> replay);
// Runs every queued replay to its end; returns at once when none waits or within a
// RunningReplaysScope. Another thread that calls it meanwhile waits for them to finish.
void run_queued_replays();

}  // namespace supa
