// The device guard PyTorch uses for `supa`: current device, streams and events.
//
// Work runs synchronously on the host; a stream is busy only for the time `_sleep` queued on it
// (stream_timeline.h), and an event completes when the work its stream had queued at its record
// does. Streams have identities (ids per device, 0 is the default stream); events carry the
// time their stream reaches them, which is what elapsed_time measures, and during a graph capture
// the order they give the capture's streams (capture_order.h).
#include "device_guard.h"

#include "caching_allocator.h"
#include "capture_order.h"
#include "devices.h"
#include "gpu_trace.h"
#include "graph.h"
#include "op_trace.h"
#include "replay_queue.h"
#include "stream_timeline.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstddef>

namespace supa {
namespace {

struct HostEvent {
  c10::DeviceIndex device;
  bool recorded = false;
  bool timing;
  int64_t time_ns = 0;  // when the recording stream reaches the event (stream_timeline.h)
  CapturePointsPtr capture_points;  // recorded during a graph capture: what a wait on it orders after
};

// An index-less device means the current one, as in CUDA's stream functions.
c10::DeviceIndex resolved_index(c10::Device d) {
  if (d.index() == -1) {
    return current_device();
  }
  check_device_index(d.index());
  return d.index();
}

std::atomic<c10::StreamId> g_next_stream_index{1};

// Priority range (0, -1), as Stream.priority_range() reports: the lowest id bit marks the
// high-priority streams; the default stream (id 0) has priority 0.
c10::StreamId new_stream_id(int priority) {
  return (g_next_stream_index++ << 1) | (priority < 0 ? 1 : 0);
}
// Current stream per device, per thread (as in CUDA): a plain array indexed by the device (0 is
// the default stream), which a thread reads without an initialisation guard or a hash at every
// allocation.
constexpr size_t kStreamSlots = size_t{1} << (8 * sizeof(c10::DeviceIndex) - 1);
thread_local std::array<c10::StreamId, kStreamSlots> t_current_streams{};

struct SupaGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kSupa;
  }
  c10::Device exchangeDevice(c10::Device d) const override {
    check_device_index(d.index());
    return {kSupa, exchange_device(d.index())};
  }
  c10::Device getDevice() const override {
    return {kSupa, current_device()};
  }
  void setDevice(c10::Device d) const override {
    set_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < device_count()) {
      set_device(d.index());
    }
  }
  c10::Stream getStream(c10::Device d) const override {
    const c10::DeviceIndex index = resolved_index(d);
    return c10::Stream(c10::Stream::UNSAFE, {kSupa, index}, current_stream_id(index));
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, {kSupa, resolved_index(d)}, 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return getNewStream(d, high_priority ? -1 : 0);
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return c10::Stream(c10::Stream::UNSAFE, {kSupa, resolved_index(d)}, new_stream_id(priority));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    check_device_index(s.device_index());
    const c10::Stream old = getStream(s.device());
    t_current_streams[s.device_index()] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "Event device index ",
                device_index, " does not match recording stream's device index ", stream.device_index(), ".");
    run_queued_replays();  // an event orders work: the replays launched before it run first
    auto* e = static_cast<HostEvent*>(*event);
    if (e == nullptr) {
      e = new HostEvent{stream.device_index(), false, flag == c10::EventFlag::BACKEND_DEFAULT};
      *event = e;
      // As CUDA's guard: an event exists from its first record.
      report_to_gpu_trace([&](const auto& trace) {
        trace->trace_gpu_event_creation(kSupa, reinterpret_cast<uintptr_t>(e));
      });
    }
    e->recorded = true;
    e->time_ns = stream_ready_ns(stream.device_index(), stream.id());
    op_trace_event(TraceKind::kEventRecord, reinterpret_cast<uintptr_t>(e), stream.device_index(), stream.id());
    e->capture_points = capture_points_at_record(stream.device_index(), stream.id());
    report_to_gpu_trace([&](const auto& trace) {
      trace->trace_gpu_event_record(kSupa, reinterpret_cast<uintptr_t>(e), static_cast<uintptr_t>(stream.id()));
    });
  }
  void block(void* event, const c10::Stream& stream) const override {
    run_queued_replays();
    if (event != nullptr) {
      stream_wait_until(stream.device_index(), stream.id(), static_cast<HostEvent*>(event)->time_ns);
      op_trace_event(TraceKind::kEventWait, reinterpret_cast<uintptr_t>(event), stream.device_index(), stream.id());
      capture_order_wait(stream.device_index(), stream.id(), static_cast<HostEvent*>(event)->capture_points);
      report_to_gpu_trace([&](const auto& trace) {
        trace->trace_gpu_event_wait(kSupa, reinterpret_cast<uintptr_t>(event), static_cast<uintptr_t>(stream.id()));
      });
    }
  }
  bool queryEvent(void* event) const override {
    run_queued_replays();
    return event == nullptr || static_cast<HostEvent*>(event)->time_ns <= now_ns();
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    if (event != nullptr) {
      report_to_gpu_trace([&](const auto& trace) {
        trace->trace_gpu_event_deletion(kSupa, reinterpret_cast<uintptr_t>(event));
      });
    }
    delete static_cast<HostEvent*>(event);
  }
  bool queryStream(const c10::Stream& stream) const override {
    run_queued_replays();
    return stream_ready_ns(stream.device_index(), stream.id()) <= now_ns();
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    run_queued_replays();
    wait_until_ns(stream_ready_ns(stream.device_index(), stream.id()));
    op_trace_event(TraceKind::kStreamSync, 0, stream.device_index(), stream.id());
    report_to_gpu_trace([&](const auto& trace) {
      trace->trace_gpu_stream_synchronization(kSupa, static_cast<uintptr_t>(stream.id()));
    });
  }
  void synchronizeEvent(void* event) const override {
    run_queued_replays();
    if (event != nullptr) {
      wait_until_ns(static_cast<HostEvent*>(event)->time_ns);
      op_trace_event(TraceKind::kEventSync, reinterpret_cast<uintptr_t>(event), static_cast<HostEvent*>(event)->device, 0);
      report_to_gpu_trace([&](const auto& trace) {
        trace->trace_gpu_event_synchronization(kSupa, reinterpret_cast<uintptr_t>(event));
      });
    }
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    check_device_index(device_index);
    run_queued_replays();
    wait_until_ns(device_ready_ns(device_index));
    op_trace_event(TraceKind::kDeviceSync, 0, device_index, 0);
    report_to_gpu_trace([](const auto& trace) { trace->trace_gpu_device_synchronization(kSupa); });
  }
  bool isStreamCapturing(const c10::Stream& stream) const override {
    return is_stream_captured(stream.device_index(), stream.id());
  }
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& stream) const override {
    device_allocator()->recordStream(data_ptr, stream);
  }
  // CUDA's checks and messages. c10::Event (the way torch.Event and torch.supa.Event come here)
  // makes the flag, record and completion checks first, in CUDA's order; they are repeated for
  // callers of the guard itself, which cannot tell a timing flag of an event never recorded.
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    auto* a = static_cast<HostEvent*>(start);
    auto* b = static_cast<HostEvent*>(end);
    TORCH_CHECK_VALUE(a != nullptr && b != nullptr && a->recorded && b->recorded,
                      "Both events must be recorded before calculating elapsed time.");
    TORCH_CHECK_VALUE(a->timing && b->timing, "Both events must be created with argument 'enable_timing=True'.");
    TORCH_CHECK(queryEvent(a) && queryEvent(b), "Both events must be completed before calculating elapsed time.");
    if (a->device != b->device) {
      // What cudaEventElapsedTime answers for events of two devices (cudaErrorInvalidResourceHandle).
      throw c10::AcceleratorError(
          {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, 400,
          c10::str("SUPA error: invalid resource handle (elapsed time between an event of supa:",
                   static_cast<int>(a->device), " and one of supa:", static_cast<int>(b->device), ")"));
    }
    return static_cast<double>(b->time_ns - a->time_ns) / 1.0e6;
  }
};

}  // namespace

int stream_priority(c10::StreamId id) {
  return (id & 1) != 0 ? -1 : 0;
}

c10::StreamId current_stream_id(c10::DeviceIndex device) {
  return device >= 0 ? t_current_streams[static_cast<size_t>(device)] : 0;
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, SupaGuardImpl);

}  // namespace supa
