// Kineto asks each child profiler for a session when a profile is configured; this one answers
// when the card's kernels are asked for (the device activity), records the launches while the
// profile runs (op_trace.cpp), and when the profile is processed hands them to the Python model
// (supa_emu/card_time.py), which gives each its place on its stream of the modelled card. The
// activities it logs are linked to the operator that launched them, so torch.profiler counts
// them as that operator's device time, and Chrome traces get a track per card stream.
#include "card_time_profiler.h"

#include "devices.h"
#include "op_trace.h"
#include "op_trace_bindings.h"

// The wheel's Kineto is built in (USE_KINETO), but its headers only declare the registry with it.
#ifndef USE_KINETO
#define USE_KINETO
#endif
#include <libkineto.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <c10/util/ApproximateClock.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace supa {
namespace {

namespace py = pybind11;
using libkineto::ActivityType;

// The Python model: [(operator, device, stream, host start ns, host end ns, inputs, outputs)] ->
// per launch None (nothing runs on the card) or (name, "kernel"|"memcpy", start ns, end ns, FLOPs,
// bytes). Kept for the process's life, as the registration with Kineto is.
PyObject* g_model = nullptr;
std::string g_card;  // the profile's name, for the track's label
std::atomic<int32_t> g_next_id{1};

// The Python model's answer for `launches` into `placed`; false (and a warning) if it raised: the
// profile is being stopped, so say so rather than lose the card's times quietly. Needs the GIL.
bool place_on_card(const std::vector<ProfiledLaunch>& launches, py::list& placed) {
  const auto names = op_trace_names();
  py::list items;
  for (const auto& l : launches) {
    const py::tuple args = decode_trace_args(l.args);
    items.append(py::make_tuple(names[l.name], l.device, l.stream, l.host_start_ns, l.host_end_ns, args[0], args[1]));
  }
  try {
    placed = py::reinterpret_borrow<py::object>(g_model)(items);
    return true;
  } catch (py::error_already_set& error) {
    PyErr_WarnEx(PyExc_RuntimeWarning, (std::string("supa_emu: this profile has no card times: ") + error.what()).c_str(), 1);
    return false;
  }
}

class CardTimeSession final : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    op_trace_set_profiling(true);
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    op_trace_set_profiling(false);
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override {
    return errors_;
  }

  void processTrace(libkineto::ActivityLogger& logger) override {
    place(logger, nullptr);
  }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked,
                    int64_t /*window_start*/, int64_t /*window_end*/) override {
    place(logger, linked);
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    if (streams_.empty()) {
      return nullptr;
    }
    const int64_t device = streams_.begin()->first;
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{
        device, kSortAfterHost + device, "SUPA " + std::to_string(device) + " (modelled: " + g_card + ")",
        "SUPA " + std::to_string(device)});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> infos;
    for (const auto& [device, stream] : streams_) {
      infos.push_back({stream, stream, device, "stream " + std::to_string(stream)});
    }
    return infos;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override {
    return std::move(buffer_);  // Kineto keeps the activities logged from it alive with the trace
  }

  void pushCorrelationId(uint64_t id) override {
    op_trace_push_correlation(id);
  }

  void popCorrelationId() override {
    op_trace_pop_correlation();
  }

 private:
  static constexpr int64_t kSortAfterHost = 1 << 24;  // card tracks below the host's

  void place(libkineto::ActivityLogger& logger, const libkineto::getLinkedActivityCallback& linked) {
    auto launches = op_trace_take_profiled();
    if (launches.empty() || buffer_ == nullptr || g_model == nullptr) {
      return;
    }
    py::gil_scoped_acquire gil;
    py::list placed;
    if (!place_on_card(launches, placed)) {
      errors_.push_back("the card model failed");
      return;
    }
    buffer_->span = libkineto::TraceSpan(0, 0, "SUPA card (modelled)");
    buffer_->gpuOpCount = 0;
    for (size_t i = 0; i < launches.size() && i < placed.size(); ++i) {
      if (placed[i].is_none()) {
        continue;
      }
      const auto p = placed[i].cast<py::tuple>();
      const auto& l = launches[i];
      const bool copy = p[1].cast<std::string>() == "memcpy";
      buffer_->emplace_activity(buffer_->span, copy ? ActivityType::GPU_MEMCPY : ActivityType::CONCURRENT_KERNEL,
                                p[0].cast<std::string>());
      auto& a = *buffer_->activities.back();
      a.startTime = p[2].cast<int64_t>();
      a.endTime = p[3].cast<int64_t>();
      a.device = l.device;
      a.resource = static_cast<int32_t>(l.stream);
      a.id = g_next_id++;
      a.linked = linked && l.correlation != 0 ? linked(static_cast<int32_t>(l.correlation)) : nullptr;
      a.addMetadataQuoted("card", g_card);
      a.addMetadataQuoted("FLOPs", py::str(p[4]).cast<std::string>());
      a.addMetadataQuoted("bytes", py::str(p[5]).cast<std::string>());
      streams_.insert({l.device, l.stream});
      logger.handleActivity(a);
      auto& span = buffer_->span;
      span.startTime = span.opCount++ == 0 ? a.startTime : std::min(span.startTime, a.startTime);
      span.endTime = std::max(span.endTime, a.endTime);
    }
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> buffer_ = std::make_unique<libkineto::CpuTraceBuffer>();
  std::vector<std::string> errors_;
  std::set<std::pair<int64_t, int64_t>> streams_;
};

class CardTimeProfiler final : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override {
    static const std::string name = "supa_emu card time";
    return name;
  }

  const std::set<ActivityType>& availableActivities() const override {
    static const std::set<ActivityType> activities = {ActivityType::CONCURRENT_KERNEL, ActivityType::GPU_MEMCPY};
    return activities;
  }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<ActivityType>& types,
                                                                 const libkineto::Config& /*config*/) override {
    if (types.count(ActivityType::CONCURRENT_KERNEL) == 0) {
      return nullptr;  // a profile of the host alone
    }
    return std::make_unique<CardTimeSession>();
  }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t /*ts_ms*/, int64_t /*duration_ms*/,
                                                                 const std::set<ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }
};

// The profiler without Kineto (torch.autograd.profiler.profile with use_kineto=False: PyTorch's
// KINETO_PRIVATEUSE1_FALLBACK, or KINETO_GPU_FALLBACK for use_cuda under the transfer) records an
// event as each operator starts and ends and asks for the device time between two: here the
// modelled time of the launches whose host interval's middle lies between them (those of the
// operator and of what it calls). The first event of a profile starts recording the launches; the
// first question, asked once the profile has stopped, ends it.
class CardTimeStubs final : public torch::profiler::impl::ProfilerStubs {
 public:
  void record(c10::DeviceIndex* device, torch::profiler::impl::ProfilerVoidEventStub* event,
              int64_t* cpu_ns) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!recording_) {
      timed_.clear();
      op_trace_set_profiling(true);
      recording_ = true;
    }
    const int64_t now = c10::getTime();
    if (device != nullptr) {
      *device = current_device();
    }
    *event = std::make_shared<int64_t>(now);
    if (cpu_ns != nullptr) {
      *cpu_ns = now;
    }
  }

  float elapsed(const torch::profiler::impl::ProfilerVoidEventStub* start,
                const torch::profiler::impl::ProfilerVoidEventStub* end) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (recording_) {
      op_trace_set_profiling(false);
      recording_ = false;
      time_launches();
    }
    const int64_t from = *static_cast<const int64_t*>(start->get());
    const int64_t to = *static_cast<const int64_t*>(end->get());
    double ns = 0;
    for (const auto& [middle, busy] : timed_) {
      if (middle >= from && middle <= to) {
        ns += busy;
      }
    }
    return static_cast<float>(ns / 1000.0);  // microseconds, as PyTorch reads the answer
  }

  // Annotations of the legacy CUDA profiler (NVTX ranges): the emulated card has no such track.
  void mark(const char* /*name*/) const override {}
  void rangePush(const char* /*name*/) const override {}
  void rangePop() const override {}

  bool enabled() const override {
    return true;
  }

  void onEachDevice(std::function<void(int)> op) const override {
    for (int device = 0; device < device_count(); ++device) {
      op(device);
    }
  }

  void synchronize() const override {}  // a launch's work is done when the host returns from it

 private:
  void time_launches() const {
    const auto launches = op_trace_take_profiled();
    if (launches.empty() || g_model == nullptr) {
      return;
    }
    py::gil_scoped_acquire gil;
    py::list placed;
    if (!place_on_card(launches, placed)) {
      return;
    }
    for (size_t i = 0; i < launches.size() && i < placed.size(); ++i) {
      if (!placed[i].is_none()) {
        const auto p = placed[i].cast<py::tuple>();
        const int64_t middle = launches[i].host_start_ns + (launches[i].host_end_ns - launches[i].host_start_ns) / 2;
        timed_.emplace_back(middle, static_cast<double>(p[3].cast<int64_t>() - p[2].cast<int64_t>()));
      }
    }
  }

  mutable std::mutex mutex_;
  mutable bool recording_ = false;
  mutable std::vector<std::pair<int64_t, double>> timed_;  // (host middle ns, card ns) per launch
};

CardTimeStubs g_stubs;  // PyTorch keeps the pointer for the process's life

void enable_card_time(py::object model, const std::string& card, bool as_cuda) {
  if (g_model != nullptr) {
    Py_DECREF(g_model);
  }
  g_model = model.release().ptr();
  g_card = card;
  static std::once_flag registered;
  std::call_once(registered, [] {
    auto& registry = torch::profiler::impl::PrivateUse1ProfilerRegistry::instance();
    registry.registerFactory([] { return std::make_unique<CardTimeProfiler>(); });
    // PyTorch forwards the factory to Kineto only for its KINETO_PRIVATEUSE1 state; under the
    // transfer the device activity is requested as CUDA's, so forward it now (Kineto adds it
    // when it starts, or at once if it has).
    registry.onKinetoInit();
    torch::profiler::impl::registerPrivateUse1Methods(&g_stubs);
  });
  if (as_cuda) {  // the transfer: use_cuda means the supa card, and PyTorch asks CUDA's stubs
    torch::profiler::impl::registerCUDAMethods(&g_stubs);
  }
}

}  // namespace

void bind_card_time_profiler(py::module& m) {
  m.def("_card_time_enable", &enable_card_time, py::arg("model"), py::arg("card"), py::arg("as_cuda"),
        "Give torch.profiler's device activity the card's kernels, placed by `model` (supa_emu.card_time)");
}

}  // namespace supa
