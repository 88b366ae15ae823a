// Kineto asks each child profiler for a session when a profile is configured; this one answers
// when the card's kernels are asked for (the device activity), records the launches while the
// profile runs (op_trace.cpp), and when the profile is processed hands them to the Python model
// (supa_emu/card_time.py), which gives each its place on its stream of the modelled card. The
// activities it logs are linked to the operator that launched them, so torch.profiler counts
// them as that operator's device time, and Chrome traces get a track per card stream.
#include "card_time_profiler.h"

#include "op_trace.h"
#include "op_trace_bindings.h"

// The wheel's Kineto is built in (USE_KINETO), but its headers only declare the registry with it.
#ifndef USE_KINETO
#define USE_KINETO
#endif
#include <libkineto.h>
#include <output_base.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
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
    const auto names = op_trace_names();
    py::gil_scoped_acquire gil;
    py::list items;
    for (const auto& l : launches) {
      const py::tuple args = decode_trace_args(l.args);
      items.append(py::make_tuple(names[l.name], l.device, l.stream, l.host_start_ns, l.host_end_ns, args[0], args[1]));
    }
    py::list placed;
    try {
      placed = py::reinterpret_borrow<py::object>(g_model)(items);
    } catch (py::error_already_set& error) {
      // Kineto runs this while stopping the profile: say so rather than lose the card track quietly.
      const std::string what = error.what();
      errors_.push_back(what);
      PyErr_WarnEx(PyExc_RuntimeWarning, ("supa_emu: the card track of this profile is empty: " + what).c_str(), 1);
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

void enable_card_time(py::object model, const std::string& card) {
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
  });
}

}  // namespace

void bind_card_time_profiler(py::module& m) {
  m.def("_card_time_enable", &enable_card_time, py::arg("model"), py::arg("card"),
        "Give torch.profiler's device activity the card's kernels, placed by `model` (supa_emu.card_time)");
}

}  // namespace supa
