// RecordFunction's inline inputs() asserts a debug-only flag (present without NDEBUG) that the
// release libtorch never sets: this file sees the header as libtorch was built. It leads its
// unit (supa_emu/native.py), before anything includes the header.
#ifndef NDEBUG
#define NDEBUG
#define SUPA_OP_TRACE_DEFINED_NDEBUG
#endif

#include "op_trace.h"

#include "caching_allocator.h"
#include "device_guard.h"
#include "devices.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/util/ApproximateClock.h>

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace supa {
namespace {

std::atomic<bool> g_trace_enabled{false};
std::once_flag g_trace_installed;
std::mutex g_trace_mutex;  // guards the entries and the names
std::vector<TraceEntry> g_trace_entries;
std::vector<std::string> g_trace_names;
std::unordered_map<std::string, int64_t> g_trace_name_index;

thread_local int t_trace_paused = 0;
thread_local int t_trace_inside = 0;  // inside a recorded launch: what it calls is the kernel

// The profiler's launches: a callback of their own, added while a profile records.
std::mutex g_profile_mutex;  // guards the handle and the launches
at::CallbackHandle g_profile_callback = 0;
std::vector<ProfiledLaunch> g_profiled;
thread_local int t_profile_inside = 0;
thread_local std::vector<uint64_t> t_correlations;

struct TracedLaunch : at::ObserverContext {
  TraceEntry entry;
};

// Where an IValue sits on the card, if it does: its device index, else -1.
int traced_device_of(const c10::IValue& v) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    return t.defined() && t.device().type() == kSupa ? t.device().index() : -1;
  }
  if (v.isDevice()) {
    const auto d = v.toDevice();
    return d.type() == kSupa ? (d.has_index() ? d.index() : current_device()) : -1;
  }
  if (v.isTensorList() || v.isList()) {
    for (const auto& item : v.toListRef()) {
      const int d = traced_device_of(item);
      if (d >= 0) {
        return d;
      }
    }
  }
  return -1;
}

// A tensor subclass that dispatches in Python (DTensor, a fake tensor) reports sizes of its own
// (a DTensor its global ones, N times what the card holds); its operator runs as the operators it
// calls on its plain tensors, and those are the launches.
bool traced_python_subclass(const c10::IValue& v) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    return t.defined() && t.key_set().has(c10::DispatchKey::Python);
  }
  if (v.isTensorList() || v.isList()) {
    for (const auto& item : v.toListRef()) {
      if (traced_python_subclass(item)) {
        return true;
      }
    }
  }
  return false;
}

void encode_trace_arg(const c10::IValue& v, std::vector<int64_t>& out) {
  if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (!t.defined()) {
      out.push_back(kNone);
      return;
    }
    const auto type = t.device().type();
    out.push_back(kTensor);
    out.push_back(static_cast<int64_t>(t.scalar_type()));
    out.push_back(type == c10::DeviceType::CPU ? 0 : type == kSupa ? 1 : 2);
    const auto sizes = t.sym_sizes();
    out.push_back(static_cast<int64_t>(sizes.size()));
    for (const auto& s : sizes) {
      out.push_back(s.maybe_as_int().value_or(-1));
    }
  } else if (v.isInt() || v.isSymInt()) {
    out.push_back(kInt);
    out.push_back(v.isInt() ? v.toInt() : v.toSymInt().maybe_as_int().value_or(-1));
  } else if (v.isDouble()) {
    const double d = v.toDouble();
    int64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    out.push_back(kDouble);
    out.push_back(bits);
  } else if (v.isBool()) {
    out.push_back(kBool);
    out.push_back(v.toBool());
  } else if (v.isNone()) {
    out.push_back(kNone);
  } else if (v.isIntList()) {
    const auto list = v.toIntVector();
    out.push_back(kIntList);
    out.push_back(static_cast<int64_t>(list.size()));
    out.insert(out.end(), list.begin(), list.end());
  } else if (v.isTensorList() || v.isList()) {
    const auto items = v.toListRef();
    out.push_back(kList);
    out.push_back(static_cast<int64_t>(items.size()));
    for (const auto& item : items) {
      encode_trace_arg(item, out);
    }
  } else if (v.isDevice()) {
    out.push_back(kDevice);
    out.push_back(v.toDevice().type() == kSupa ? 1 : 0);
  } else {
    out.push_back(kOther);
  }
}

int64_t trace_name_index(const c10::OperatorName& name) {
  std::string full = name.name;
  if (!name.overload_name.empty()) {
    full += "." + name.overload_name;
  }
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  const auto found = g_trace_name_index.find(full);
  if (found != g_trace_name_index.end()) {
    return found->second;
  }
  g_trace_names.push_back(full);
  return g_trace_name_index[full] = static_cast<int64_t>(g_trace_names.size() - 1);
}

struct TracedOpInfo {
  bool launch;  // runs a supa kernel (registered, or the boxed fallback) rather than decomposing
  int64_t name;
};

// Per thread, keyed by the operator's schema strings (stable for the operator's lifetime).
const TracedOpInfo& traced_op_info(const at::RecordFunction& fn) {
  thread_local std::map<std::pair<const char*, const char*>, TracedOpInfo> cache;
  const auto key = std::make_pair(fn.name(), fn.overload_name());
  const auto found = cache.find(key);
  if (found != cache.end()) {
    return found->second;
  }
  const auto name = fn.operator_name();
  TracedOpInfo info{false, -1};
  if (name.has_value()) {
    const auto handle = c10::Dispatcher::singleton().findOp(*name);
    bool launch = true;
    if (handle.has_value() && !handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      launch = !(handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
                 handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
                 handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional));
    }
    info = {launch, trace_name_index(*name)};
  }
  return cache.emplace(key, info).first->second;
}

// The card a launch runs on and its name index, or -1: not a launch (no supa operand, or a
// composite that decomposes into launches).
std::pair<int, int64_t> launch_of(const at::RecordFunction& fn) {
  int device = -1;
  for (const auto& input : fn.inputs()) {
    if (traced_python_subclass(input)) {
      return {-1, -1};
    }
    if (device < 0) {
      device = traced_device_of(input);
    }
  }
  if (device < 0) {
    return {-1, -1};
  }
  const TracedOpInfo& info = traced_op_info(fn);
  if (!info.launch || info.name < 0) {
    return {-1, -1};
  }
  return {device, info.name};
}

void encode_inputs(const at::RecordFunction& fn, std::vector<int64_t>& args) {
  for (const auto& input : fn.inputs()) {
    encode_trace_arg(input, args);
  }
}

void encode_outputs(const at::RecordFunction& fn, std::vector<int64_t>& args) {
  args.push_back(kOutputs);
  for (const auto& output : fn.outputs()) {
    encode_trace_arg(output, args);
  }
}

std::unique_ptr<at::ObserverContext> on_trace_start(const at::RecordFunction& fn) {
  if (!g_trace_enabled.load(std::memory_order_relaxed) || t_trace_paused > 0 || t_trace_inside > 0) {
    return nullptr;
  }
  const auto [device, name] = launch_of(fn);
  if (device < 0) {
    return nullptr;
  }
  auto launch = std::make_unique<TracedLaunch>();
  auto& e = launch->entry;
  e.kind = TraceKind::kOp;
  e.name = name;
  e.device = static_cast<c10::DeviceIndex>(device);
  e.stream = current_stream_id(e.device);
  e.aux = 0;
  encode_inputs(fn, e.args);
  ++t_trace_inside;
  return launch;
}

void on_trace_end(const at::RecordFunction& fn, at::ObserverContext* context) {
  if (context == nullptr) {
    return;
  }
  --t_trace_inside;
  auto& e = static_cast<TracedLaunch*>(context)->entry;
  encode_outputs(fn, e.args);
  // The card's allocated bytes once the launch returned: the trace's memory counter.
  e.aux = device_allocator()->getDeviceStats(e.device).allocated_bytes[0].current;
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  g_trace_entries.push_back(std::move(e));
}

struct ProfiledContext : at::ObserverContext {
  ProfiledLaunch launch;
  size_t depth;  // the correlation stack when the launch began, and its top
  uint64_t top;
};

std::unique_ptr<at::ObserverContext> on_profile_start(const at::RecordFunction& fn) {
  if (t_trace_paused > 0 || t_profile_inside > 0) {
    return nullptr;
  }
  const auto [device, name] = launch_of(fn);
  if (device < 0) {
    return nullptr;
  }
  auto context = std::make_unique<ProfiledContext>();
  auto& l = context->launch;
  l.name = name;
  l.device = static_cast<c10::DeviceIndex>(device);
  l.stream = current_stream_id(l.device);
  l.host_start_ns = c10::getTime();
  encode_inputs(fn, l.args);
  context->depth = t_correlations.size();
  context->top = t_correlations.empty() ? 0 : t_correlations.back();
  ++t_profile_inside;
  return context;
}

void on_profile_end(const at::RecordFunction& fn, at::ObserverContext* observed) {
  if (observed == nullptr) {
    return;
  }
  --t_profile_inside;
  auto* context = static_cast<ProfiledContext*>(observed);
  auto& l = context->launch;
  l.host_end_ns = c10::getTime();
  encode_outputs(fn, l.args);
  // The profiler's own callback pushes this operator's id as it starts and pops it as it ends;
  // whether it runs before or after this one, the stack was one deeper at one end of the launch.
  l.correlation = t_correlations.size() > context->depth ? t_correlations.back() : context->top;
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  g_profiled.push_back(std::move(l));
}

}  // namespace

void op_trace_set_profiling(bool on) {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  if (on && g_profile_callback == 0) {
    g_profiled.clear();
    g_profile_callback = at::addGlobalCallback(at::RecordFunctionCallback(&on_profile_start, &on_profile_end)
                                                   .needsInputs(true)
                                                   .needsOutputs(true)
                                                   .scopes({at::RecordScope::FUNCTION}));
  } else if (!on && g_profile_callback != 0) {
    at::removeCallback(g_profile_callback);
    g_profile_callback = 0;
  }
}

void op_trace_push_correlation(uint64_t id) {
  t_correlations.push_back(id);
}

void op_trace_pop_correlation() {
  if (!t_correlations.empty()) {
    t_correlations.pop_back();
  }
}

std::vector<ProfiledLaunch> op_trace_take_profiled() {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  std::vector<ProfiledLaunch> taken;
  taken.swap(g_profiled);
  return taken;
}

void op_trace_set_enabled(bool on) {
  std::call_once(g_trace_installed, [] {
    at::addGlobalCallback(at::RecordFunctionCallback(&on_trace_start, &on_trace_end)
                              .needsInputs(true)
                              .needsOutputs(true)
                              .scopes({at::RecordScope::FUNCTION}));
  });
  g_trace_enabled.store(on);
}

bool op_trace_enabled() {
  return g_trace_enabled.load(std::memory_order_relaxed);
}

void op_trace_pause(bool paused) {
  t_trace_paused += paused ? 1 : -1;
}

void op_trace_event(TraceKind kind, uintptr_t event, c10::DeviceIndex device, c10::StreamId stream) {
  if (!op_trace_enabled() || t_trace_paused > 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  g_trace_entries.push_back({kind, -1, device, stream, static_cast<int64_t>(event), {}});
}

void op_trace_mark(int64_t value) {
  if (!op_trace_enabled()) {
    return;
  }
  const c10::DeviceIndex device = current_device();
  const c10::StreamId stream = current_stream_id(device);
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  g_trace_entries.push_back({TraceKind::kMark, -1, device, stream, value, {}});
}

std::vector<TraceEntry> op_trace_take() {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  std::vector<TraceEntry> taken;
  taken.swap(g_trace_entries);
  return taken;
}

std::vector<std::string> op_trace_names() {
  std::lock_guard<std::mutex> lock(g_trace_mutex);
  return g_trace_names;
}

}  // namespace supa

#ifdef SUPA_OP_TRACE_DEFINED_NDEBUG
#undef NDEBUG
#undef SUPA_OP_TRACE_DEFINED_NDEBUG
#endif
