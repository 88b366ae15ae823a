// The order among a device's streams while a graph captures (see capture_order.h).
//
// Each stream in the capture keeps, per stream, the last point of it that it has reached (a
// vector clock over the points capture_order_mark places); an event copies its stream's, a wait
// takes the larger of each.
#include "capture_order.h"

#include <algorithm>
#include <atomic>
#include <mutex>

namespace supa {
namespace {

struct DeviceCaptureOrder {
  uint64_t capture = 0;  // counts the device's captures
  bool active = false;
  std::map<c10::StreamId, std::map<c10::StreamId, uint64_t>> reached;  // the streams in the capture
};

std::mutex g_order_mutex;
std::map<c10::DeviceIndex, DeviceCaptureOrder> g_orders;
std::atomic<int> g_capturing_devices{0};  // lets events skip the lock while no device captures

// The device's order while it captures, else null (under g_order_mutex).
DeviceCaptureOrder* active_order(c10::DeviceIndex device) {
  auto it = g_orders.find(device);
  return it != g_orders.end() && it->second.active ? &it->second : nullptr;
}

}  // namespace

void capture_order_begin(c10::DeviceIndex device, c10::StreamId stream) {
  std::lock_guard<std::mutex> lock(g_order_mutex);
  DeviceCaptureOrder& order = g_orders[device];
  if (!order.active) {
    g_capturing_devices++;
  }
  order.capture++;
  order.active = true;
  order.reached.clear();
  order.reached[stream][stream] = 0;
}

void capture_order_end(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_order_mutex);
  if (DeviceCaptureOrder* order = active_order(device)) {
    order->active = false;
    order->reached.clear();
    g_capturing_devices--;
  }
}

CapturePointsPtr capture_points_at_record(c10::DeviceIndex device, c10::StreamId stream) {
  if (g_capturing_devices.load(std::memory_order_relaxed) == 0) {
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(g_order_mutex);
  DeviceCaptureOrder* order = active_order(device);
  if (order == nullptr) {
    return nullptr;
  }
  auto it = order->reached.find(stream);
  if (it == order->reached.end()) {
    return nullptr;
  }
  return std::make_shared<const CapturePoints>(CapturePoints{device, order->capture, it->second});
}

void capture_order_wait(c10::DeviceIndex device, c10::StreamId stream, const CapturePointsPtr& points) {
  if (points == nullptr || points->device != device || g_capturing_devices.load(std::memory_order_relaxed) == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_order_mutex);
  DeviceCaptureOrder* order = active_order(device);
  if (order == nullptr || order->capture != points->capture) {
    return;
  }
  auto& reached = order->reached[stream];
  for (const auto& [other, point] : points->reached) {
    auto [it, inserted] = reached.emplace(other, point);
    if (!inserted) {
      it->second = std::max(it->second, point);
    }
  }
}

bool capture_order_joined(c10::DeviceIndex device, c10::StreamId stream) {
  std::lock_guard<std::mutex> lock(g_order_mutex);
  const DeviceCaptureOrder* order = active_order(device);
  return order != nullptr && order->reached.count(stream) != 0;
}

uint64_t capture_order_mark(c10::DeviceIndex device, c10::StreamId stream) {
  std::lock_guard<std::mutex> lock(g_order_mutex);
  DeviceCaptureOrder* order = active_order(device);
  return order == nullptr ? 0 : ++order->reached[stream][stream];
}

bool capture_order_reached(c10::DeviceIndex device, c10::StreamId stream, c10::StreamId other, uint64_t point) {
  std::lock_guard<std::mutex> lock(g_order_mutex);
  const DeviceCaptureOrder* order = active_order(device);
  if (order == nullptr) {
    return false;
  }
  auto it = order->reached.find(stream);
  if (it == order->reached.end()) {
    return false;
  }
  auto at = it->second.find(other);
  return at != it->second.end() && at->second >= point;
}

}  // namespace supa
