// When the work queued on each stream completes (see stream_timeline.h).
#include "stream_timeline.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace supa {
namespace {

using TimelineKey = std::pair<c10::DeviceIndex, c10::StreamId>;

// Only streams with work still running are kept: an entry whose time has passed is an idle
// stream, the same as no entry, and is dropped when next looked at.
std::mutex g_timeline_mutex;
std::map<TimelineKey, int64_t> g_stream_ready_ns;

int64_t stream_ready_locked(const TimelineKey& key, int64_t now) {
  const auto it = g_stream_ready_ns.find(key);
  if (it == g_stream_ready_ns.end()) {
    return now;
  }
  if (it->second <= now) {
    g_stream_ready_ns.erase(it);
    return now;
  }
  return it->second;
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void queue_stream_work(c10::DeviceIndex device, c10::StreamId stream, int64_t ns) {
  if (ns <= 0) {
    return;
  }
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  const TimelineKey key{device, stream};
  const int64_t ready = stream_ready_locked(key, now);
  g_stream_ready_ns[key] = ns > INT64_MAX - ready ? INT64_MAX : ready + ns;  // saturates: a spin without end
}

int64_t stream_ready_ns(c10::DeviceIndex device, c10::StreamId stream) {
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  return stream_ready_locked({device, stream}, now);
}

void stream_wait_until(c10::DeviceIndex device, c10::StreamId stream, int64_t ready_ns) {
  const int64_t now = now_ns();
  if (ready_ns <= now) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  const TimelineKey key{device, stream};
  g_stream_ready_ns[key] = std::max(stream_ready_locked(key, now), ready_ns);
}

int64_t device_ready_ns(c10::DeviceIndex device) {
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(g_timeline_mutex);
  int64_t ready = now;
  const auto end = g_stream_ready_ns.end();
  for (auto it = g_stream_ready_ns.lower_bound({device, INT64_MIN}); it != end && it->first.first == device; ++it) {
    ready = std::max(ready, it->second);
  }
  return ready;
}

void wait_until_ns(int64_t ready_ns) {
  const int64_t now = now_ns();
  if (ready_ns > now) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(ready_ns - now));
  }
}

}  // namespace supa
