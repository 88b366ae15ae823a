// Graph replays waiting on busy streams (see replay_queue.h).
#include "replay_queue.h"

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace supa {
namespace {

using ReplayStreamKey = std::pair<c10::DeviceIndex, c10::StreamId>;

std::mutex g_replay_queue_mutex;  // guards g_queued_replays
std::map<ReplayStreamKey, std::deque<std::unique_ptr<QueuedReplay>>> g_queued_replays;
// Replays queued or running: the fast "nothing to do" check of every observation point.
std::atomic<int64_t> g_outstanding_replays{0};
// One thread runs the queued replays at a time; the others wait for it to finish.
std::mutex g_replay_run_mutex;
thread_local bool t_running_replays = false;

// Runs the streams' replays round-robin: one kernel of each stream's first replay per turn.
void run_replays_round_robin(std::vector<std::deque<std::unique_ptr<QueuedReplay>>>& streams) {
  bool any = true;
  while (any) {
    any = false;
    for (auto& replays : streams) {
      while (!replays.empty() && !replays.front()->run_next()) {
        replays.pop_front();  // finished: the stream's next replay takes its turn
        g_outstanding_replays.fetch_sub(1);
      }
      any = any || !replays.empty();
    }
  }
}

}  // namespace

RunningReplaysScope::RunningReplaysScope() : previous_(t_running_replays) {
  t_running_replays = true;
}

RunningReplaysScope::~RunningReplaysScope() {
  t_running_replays = previous_;
}

bool replays_pending() {
  return g_outstanding_replays.load(std::memory_order_acquire) > 0;
}

void queue_replay(c10::DeviceIndex device, c10::StreamId stream, std::unique_ptr<QueuedReplay> replay) {
  std::lock_guard<std::mutex> lock(g_replay_queue_mutex);
  g_outstanding_replays.fetch_add(1);
  g_queued_replays[{device, stream}].push_back(std::move(replay));
}

void run_queued_replays() {
  if (!replays_pending() || t_running_replays) {  // the shared counter first: no thread-local look-up per call
    return;
  }
  std::lock_guard<std::mutex> run_lock(g_replay_run_mutex);
  RunningReplaysScope running;
  while (true) {
    std::vector<std::deque<std::unique_ptr<QueuedReplay>>> streams;
    {
      std::lock_guard<std::mutex> lock(g_replay_queue_mutex);
      for (auto& [key, replays] : g_queued_replays) {
        streams.push_back(std::move(replays));
      }
      g_queued_replays.clear();
    }
    if (streams.empty()) {
      return;
    }
    try {
      run_replays_round_robin(streams);
    } catch (...) {
      // A kernel's error reaches the caller that observed, as a card's asynchronous error reaches
      // the next synchronizing call; the replays still queued are dropped.
      for (auto& replays : streams) {
        g_outstanding_replays.fetch_sub(static_cast<int64_t>(replays.size()));
      }
      throw;
    }
  }
}

}  // namespace supa
