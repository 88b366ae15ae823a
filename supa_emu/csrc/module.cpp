// Python bindings of the emulated SUPA runtime (`supa_emu.native`).
#include "aten/blas_ops.h"
#include "aten/fallback.h"
#include "runtime/op_trace_bindings.h"
#include "runtime/card_time_profiler.h"
#include "aten/sdp_choice_bindings.h"
#include "aten/half_precision_products.h"
#include "aten/shape_only.h"
#include "aten/shapes_bindings.h"
#include "bccl/card_operands.h"
#include "distributed/all_gather.h"
#include "distributed/collective_operands.h"
#include "distributed/signature_board.h"
#include "runtime/blas_workspace.h"
#include "runtime/caching_allocator.h"
#include "runtime/device_guard.h"
#include "runtime/device_strings.h"
#include "runtime/devices.h"
#include "runtime/generator.h"
#include "runtime/graph.h"
#include "runtime/hooks.h"
#include "runtime/host_alias.h"
#include "runtime/host_routing_allocator.h"
#include "runtime/ipc_memory.h"
#include "runtime/mem_pool.h"
#include "runtime/memcheck.h"
#include "runtime/memory_history.h"
#include "runtime/stream_timeline.h"

// Only the Python-binding headers: torch/extension.h would add the whole C++ frontend (nn,
// optim, data), which this file does not use and which dominated the build time.
#include <torch/csrc/Event.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/AllocatorConfig.h>

#include <limits>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

// From torch/csrc/profiler/python/combined_traceback.h, which cannot be included here: it pulls
// in nlohmann/json.hpp, which the installed torch does not ship. Both are exported by
// libtorch_python with these exact signatures.
namespace torch {
std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
void installCapturedTracebackPython();
}  // namespace torch

namespace {

// A device index from Python, narrowed to c10::DeviceIndex (8 bits) only once it fits: narrowed
// first, 1 << 20 would wrap onto device 0. Negative indices that fit pass, for the callees that
// give them a meaning (-1: none, or all devices).
c10::DeviceIndex device_arg(int64_t index) {
  if (index < std::numeric_limits<c10::DeviceIndex>::min() || index > std::numeric_limits<c10::DeviceIndex>::max()) {
    supa::check_device_index(index);
  }
  return static_cast<c10::DeviceIndex>(index);
}

void init(int count, const std::vector<int64_t>& capacities, bool dtype_demotion, bool shapes) {
  supa::init_devices(count, capacities, dtype_demotion, /*lazy_backing=*/shapes);
  supa::set_shapes_mode(shapes);
  supa::install_host_routing_allocator();
  supa::register_hooks();
  supa::register_graph_impl();
  supa::register_blas_ops();
  supa::route_composite_ops_to_cpu_kernels();
}

py::tuple default_generators() {
  const int n = supa::device_count();
  py::tuple generators(n);
  for (int i = 0; i < n; ++i) {
    generators[i] = py::reinterpret_steal<py::object>(
        THPGenerator_initDefaultGenerator(supa::default_generator(static_cast<c10::DeviceIndex>(i))));
  }
  return generators;
}

// Python frames of recorded stacks, as lists of {"name", "filename", "line"} dicts.
std::vector<py::object> symbolize(const std::vector<std::shared_ptr<torch::CapturedTraceback>>& stacks) {
  std::vector<torch::CapturedTraceback*> present;
  for (const auto& stack : stacks) {
    if (stack) {
      present.push_back(stack.get());
    }
  }
  std::vector<py::object> symbolized;
  if (!present.empty()) {
    symbolized = torch::py_symbolize(present);
  }
  std::vector<py::object> out;
  size_t next = 0;
  for (const auto& stack : stacks) {
    out.push_back(stack ? symbolized.at(next++) : py::list());
  }
  return out;
}

// Shapes mode's notes: [{kind, op, count, frames of the first call}].
py::list shapes_notes() {
  py::list out;
  for (const auto& note : supa::shapes_notes()) {
    py::dict entry;
    entry["kind"] = note.kind;
    entry["op"] = note.op;
    entry["count"] = note.count;
    entry["frames"] = note.first_site ? symbolize({note.first_site})[0] : py::list();
    out.append(entry);
  }
  return out;
}

py::tuple pool_id(int64_t graph_id, int64_t user_id) {
  return py::make_tuple(graph_id, user_id);
}

// The frame that names a BLAS workspace in a snapshot, above the Python frames of the call that made it.
py::dict workspace_frame(const supa::BlasWorkspaceInfo& workspace) {
  std::ostringstream name;
  name << "supa BLAS " << (workspace.kind == "workspace" ? "workspace" : "Lt workspace") << " (handle 0x" << std::hex
       << workspace.handle << std::dec << ", stream " << workspace.stream << ")";
  py::dict frame;
  frame["name"] = name.str();
  frame["filename"] = "supa_emu/csrc/runtime/blas_workspace.cpp";
  frame["line"] = 0;
  return frame;
}

py::list memory_snapshot(int64_t device) {
  std::unordered_map<uintptr_t, supa::BlasWorkspaceInfo> workspaces;
  for (const auto& workspace : supa::blas_workspaces()) {
    workspaces.emplace(reinterpret_cast<uintptr_t>(workspace.ptr), workspace);
  }
  py::list segments;
  for (const auto& info : supa::segment_snapshot(device_arg(device))) {
    py::dict segment;
    segment["device"] = info.device;
    segment["address"] = info.address;
    segment["total_size"] = info.total_size;
    segment["allocated_size"] = info.allocated_size;
    segment["active_size"] = info.active_size;
    segment["requested_size"] = info.requested_size;
    segment["stream"] = info.stream;
    segment["segment_type"] = info.small ? "small" : "large";
    segment["segment_pool_id"] = pool_id(static_cast<int64_t>(info.pool.first), static_cast<int64_t>(info.pool.second));
    segment["is_expandable"] = info.expandable;
    segment["frames"] = py::list();
    py::list blocks;
    for (const auto& b : info.blocks) {
      py::dict block;
      block["address"] = b.address;
      block["size"] = b.size;
      block["requested_size"] = b.requested;
      block["state"] = b.allocated ? "active_allocated" : b.active ? "active_pending_free" : "inactive";
      py::list frames = b.allocated ? symbolize({supa::block_stack(reinterpret_cast<void*>(b.address))})[0]
                                    : py::list();
      if (auto it = workspaces.find(b.address); b.allocated && it != workspaces.end()) {
        frames.insert(0, workspace_frame(it->second));
      }
      block["frames"] = frames;
      blocks.append(block);
    }
    segment["blocks"] = blocks;
    segments.append(segment);
  }
  return segments;
}

const c10::Storage& unpack_storage(py::handle obj) {
  if (!THPStorage_Check(obj.ptr())) {
    throw py::type_error(std::string("expected a torch.UntypedStorage, got ") + Py_TYPE(obj.ptr())->tp_name);
  }
  return THPStorage_Unpack(obj.ptr());
}

// The recorded allocation events, one list per device, as torch.cuda.memory._snapshot() lays them out.
py::list memory_trace() {
  const auto events = supa::memory_events();
  std::vector<std::shared_ptr<torch::CapturedTraceback>> stacks;
  stacks.reserve(events.size());
  for (const auto& event : events) {
    stacks.push_back(event.stack);
  }
  const auto frames = symbolize(stacks);
  py::list per_device;
  for (int i = 0; i < supa::device_count(); ++i) {
    per_device.append(py::list());
  }
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& event = events[i];
    py::dict entry;
    entry["action"] = event.action;
    entry["addr"] = event.addr;
    entry["size"] = event.size;
    entry["block_size"] = event.block_size;  // the emulator's addition: what the planner counts
    entry["stream"] = event.stream;
    entry["time_us"] = event.time_us;
    entry["frames"] = frames[i];
    entry["compile_context"] = event.compile_context;
    entry["user_metadata"] = event.user_metadata;
    if (event.action == "oom") {
      entry["device_free"] = supa::device_allocator()->getMemoryInfo(event.device).first;
    }
    per_device[event.device].cast<py::list>().append(entry);
  }
  return per_device;
}

// The record_function ranges entered and left while recording, as torch.cuda's "external_annotations".
py::list memory_annotations() {
  py::list out;
  for (const auto& annotation : supa::memory_annotations()) {
    py::dict entry;
    entry["name"] = annotation.name;
    entry["stage"] = annotation.stage;
    entry["device"] = annotation.device;
    entry["time_us"] = annotation.time_us;
    out.append(entry);
  }
  return out;
}

// Through c10::Event, which checks the events' flags, records and completion as CUDA's events do
// (ValueError, ValueError, RuntimeError, in that order) before the device guard measures
// (device_guard.cpp), as the CUDA runtime's errors reach torch.cuda.Event users.
double event_elapsed_ms(py::handle start, py::handle end) {
  TORCH_CHECK_TYPE(THPEvent_Check(start.ptr()) && THPEvent_Check(end.ptr()),
                   "elapsed time is measured between two torch.Event objects");
  const c10::Event& a = reinterpret_cast<THPEvent*>(start.ptr())->event;
  const c10::Event& b = reinterpret_cast<THPEvent*>(end.ptr())->event;
  return a.elapsedTime(b);
}

// `context`: a supa::StackContext (0 none, 1 state, 2 alloc, 3 all).
void set_memory_history(bool recording, int context, bool cpp_stacks, size_t max_entries, bool clear,
                        bool compile_context, bool global_annotations, const std::vector<std::string>& skip_actions) {
  TORCH_CHECK(context >= 0 && context <= 3, "supa_emu: stack context level ", context, " out of range");
  if (context > 0) {
    static bool installed = false;  // the GIL serialises this
    if (!installed) {
      torch::installCapturedTracebackPython();
      supa::set_gil_probe([] { return PyGILState_Check() != 0; });
      installed = true;
    }
  }
  supa::HistorySettings settings;
  settings.recording = recording;
  settings.context = static_cast<supa::StackContext>(context);
  settings.cpp_stacks = cpp_stacks;
  settings.max_entries = max_entries;
  settings.clear = clear;
  settings.compile_context = compile_context;
  settings.global_annotations = global_annotations;
  settings.skip_actions = skip_actions;
  supa::set_memory_history(settings);
}

// PyTorch's own settings entry (torch._C._accelerator_setAllocatorSettings) hands the string to
// the accelerator's config hook, as it does CUDA's: `apply` (supa_emu/supa/_allocator_config.py)
// applies it to supa's allocator; a bad entry reaches Python as ValueError, CUDA's error type.
// False, and nothing registered, when another backend's hook owns the device keys already.
bool install_accelerator_settings_hook(py::function apply, const std::vector<std::string>& keys) {
  using c10::CachingAllocator::AcceleratorAllocatorConfig;
  const auto& known = AcceleratorAllocatorConfig::getKeys();
  if (known.count("backend") != 0) {
    return false;
  }
  std::unordered_set<std::string> device_keys;
  for (const std::string& key : keys) {
    if (known.count(key) == 0) {
      device_keys.insert(key);
    }
  }
  static py::object* g_apply = nullptr;  // never destroyed: c10 may call the hook until exit
  if (g_apply == nullptr) {
    g_apply = new py::object(std::move(apply));
  } else {
    *g_apply = std::move(apply);
  }
  AcceleratorAllocatorConfig::registerDeviceConfigParserHook(
      [](const std::string& settings) {
        py::gil_scoped_acquire gil;
        try {
          (*g_apply)(settings);
        } catch (py::error_already_set& e) {
          const std::string message = py::str(e.value());
          if (e.matches(PyExc_ValueError)) {
            TORCH_CHECK_VALUE(false, message);
          }
          TORCH_CHECK(false, message);
        }
      },
      device_keys);
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native core of the emulated SUPA device";
  m.def("_init", &init, "Create the emulated devices (once per process); shapes: the planner's shapes mode",
        py::arg("count"), py::arg("capacities"), py::arg("dtype_demotion"), py::arg("shapes") = false);
  m.def("_shapes_mode", &supa::shapes_mode);
  supa::bind_op_trace(m);
  supa::bind_card_time_profiler(m);
  m.def("_shapes_notes", &shapes_notes);
  supa::bind_shapes_mode(m);
  m.def("_card_bytes_move", &supa::card_bytes_move, py::arg("nbytes"),
        "whether the host moves this many bytes of card data (in shapes mode, only small amounts)");
  m.def("_limit_host_tensors", &supa::limit_host_tensors, py::arg("bytes"));
  supa::bind_sdp_choice(m);
  m.def("_device_count", [] { return supa::device_count(); });
  m.def("_get_device", [] { return static_cast<int>(supa::current_device()); });
  m.def("_set_device", [](int64_t index) { supa::set_device(device_arg(index)); });
  m.def("_exchange_device",
        [](int64_t index) { return static_cast<int>(supa::exchange_device(device_arg(index))); });
  m.def("_set_memory_fraction", [](double fraction, int64_t device) {
    supa::set_memory_fraction(fraction, device_arg(device));
  });
  m.def("_get_memory_fraction", [](int64_t device) {
    return supa::get_memory_fraction(device_arg(device));
  });
  m.def("_set_allocator_knobs", &supa::set_allocator_knobs, py::arg("max_split_size"), py::arg("gc_threshold"),
        py::arg("divisions"), py::arg("capture_record_stream_reuse") = false, py::arg("expandable_segments") = false);
  m.def("_install_accelerator_settings_hook", &install_accelerator_settings_hook, py::arg("apply"), py::arg("keys"));
  m.def("_set_blas_workspace_sizes", &supa::set_blas_workspace_sizes, py::arg("workspace"), py::arg("lt_workspace"));
  m.def("_current_blas_handle", [](int64_t device) {
    return supa::current_blas_handle(device_arg(device));
  });
  m.def("_clear_blas_workspaces", &supa::clear_blas_workspaces);
  m.def("_choose_half_precision_kernels", &supa::choose_half_precision_kernels, py::arg("flags") = supa::host_cpu_flags());
  m.def("_capacity", [](int64_t device) { return supa::capacity(device_arg(device)); });
  m.def("_memory_snapshot", &memory_snapshot, py::arg("device") = -1);
  m.def("_raw_alloc", [](size_t nbytes, int64_t device) {
    return reinterpret_cast<uintptr_t>(supa::raw_alloc(nbytes, device_arg(device)));
  });
  m.def("_raw_delete", [](uintptr_t ptr) { supa::raw_delete(reinterpret_cast<void*>(ptr)); });
  m.def("_report_blocks_to_gpu_trace", &supa::report_blocks_to_gpu_trace);
  m.def("_host_view", &supa::host_view, "A CPU tensor over a supa tensor's memory (no copy)");
  m.def("_all_reduce_operand", &supa::all_reduce_operand,
        "bccl: the flat host view of a dense contiguous supa tensor, else None");
  m.def("_copy_rows", &supa::copy_rows,
        "bccl: fill a contiguous CPU tensor with memcpy copies of another (a whole number of them)");
  m.def("_plain_pair", &supa::plain_pair,
        "bccl: whether an all_gather's (gather=True) or reduce_scatter's output and input are dense, "
        "contiguous, of one device and dtype and of fitting sizes");
  m.def("_pair_operands", &supa::pair_operands,
        "bccl: flat host views of an all_gather's (gather=True) or reduce_scatter's output and input "
        "when they are dense, contiguous, of one dtype and of fitting sizes, else None");
  m.def("_card_operands", &supa::bccl::card_operands, py::arg("inputs"), py::arg("outputs"),
        py::arg("input_multiplier"), py::arg("output_multiplier"),
        "torch.supa.bccl: flat host views of inputs and outputs that pass its checks, else None");
  m.def("_copy_into_each", &supa::bccl::copy_into_each, py::call_guard<py::gil_scoped_release>(),
        "torch.supa.bccl: memcpy of a flat CPU tensor into each of a list of them");
  // The raw pointer, so the call itself adds no reference to what it counts.
  m.def("_work_use_count", [](c10d::Work* work) { return c10::raw::intrusive_ptr::use_count(work); },
        "How many references a c10d Work has (1: only the caller's Python object)");
  // bccl's signature board and its native launches (distributed/).
  namespace bccl = supa::bccl;
  m.def("_shared_word_wait", &bccl::shared_word_wait, py::arg("address"), py::arg("unchanged"), py::arg("timeout_s"),
        py::arg("waiters"), py::call_guard<py::gil_scoped_release>(),
        "Sleep until the shared word at `address` is woken or stops holding `unchanged` (False: timed out), "
        "counted in the word at `waiters` meanwhile");
  m.def("_shared_word_publish", &bccl::shared_word_publish, py::arg("address"), py::arg("value"), py::arg("waiters"),
        "Store `value` in the shared word at `address` (sequentially consistent) and wake its waiters "
        "if the word at `waiters` counts any");
  m.def("_board_layout", [] {
    py::dict layout;
    layout["pid"] = bccl::kPidWord;
    layout["settled"] = bccl::kSettledWord;
    layout["waiters"] = bccl::kWaitersWord;
    layout["rank_header"] = bccl::kRankHeaderWords;
    layout["sequence"] = bccl::kSequenceWord;
    layout["verdict"] = bccl::kVerdictWord;
    layout["slot_header"] = bccl::kSlotHeaderWords;
    return layout;
  }, "bccl: word offsets of the signature board (per-rank header, then per-collective slots)");
  py::class_<bccl::SignatureBoard>(m, "_SignatureBoard", "bccl: one rank's view of a group's signature board")
      .def(py::init<uintptr_t, int64_t, int64_t, int64_t, int64_t, int64_t>(), py::arg("base"), py::arg("rank"),
           py::arg("size"), py::arg("per_rank"), py::arg("ring"), py::arg("payload"))
      .def("post", &bccl::SignatureBoard::post,
           "Post a signature as collective k; -1: a slot still in use, 1/0: may start or not (head > 0), 2: head 0")
      .def("settle_agreed", &bccl::SignatureBoard::settle_agreed,
           "1 if every peer posted collective k in agreement (then settled), 0 on a mismatch, -1 if one has not posted");
  m.def("_start_all_gather", &bccl::start_all_gather, py::call_guard<py::gil_scoped_release>(),
        "bccl: start all_gather_into_tensor of flat CPU buffers on a gloo group (one all-to-all)");
  m.def("_launch_all_gather", &bccl::launch_all_gather, py::call_guard<py::gil_scoped_release>(),
        "bccl: check plain supa operands, post the signature and start the all_gather if the board allows: "
        "None (operands not plain, nothing posted) or (status, gloo work)");
  m.def("_default_generators", &default_generators);
  m.def("_set_cuda_means_supa", &supa::set_cuda_means_supa,
        "Make device strings that start with 'cuda' mean 'supa' (transfer_to_supa)");
  m.def("_cuda_means_supa", &supa::cuda_means_supa);
  m.def("_ipc_export", [](py::handle storage) {
    const supa::SharedBlock block = supa::export_storage(unpack_storage(storage));
    return py::make_tuple(block.fd, block.nbytes);
  }, "Share a supa storage with other processes: (fd, nbytes); counts one pending reference");
  m.def("_ipc_import", [](int fd, size_t nbytes, int64_t device) {
    return py::reinterpret_steal<py::object>(
        THPStorage_Wrap(supa::import_storage(fd, nbytes, device_arg(device))));
  }, "Map a shared supa storage exported by another process");
  m.def("_ipc_release_pending", [](py::handle storage) { supa::release_pending_reference(unpack_storage(storage)); });
  m.def("_ipc_is_shared", [](py::handle storage) { return supa::is_shared_storage(unpack_storage(storage)); });
  m.def("_ipc_collect", [] { return supa::collect_shared_blocks(); });
  m.def("_is_current_stream_capturing", [] { return supa::is_capturing(); });
  m.def("_register_generator_with_capture", &supa::register_generator_with_capture,
        "Keep a supa generator graph-safe in the graph now capturing (SUPAGraph.register_generator_state)");
  m.def("_stream_priority", [](int64_t stream_id) { return supa::stream_priority(stream_id); });
  m.def("_check_device_index", [](int64_t device) { supa::check_device_index(device); },
        "Raise the runtime's invalid-device-ordinal error for an index outside [0, device count)");
  m.def("_queue_stream_work", [](int64_t device, int64_t stream_id, int64_t ns) {
    supa::check_device_index(device);
    supa::queue_sleep(static_cast<c10::DeviceIndex>(device), stream_id, ns);
  }, py::arg("device"), py::arg("stream_id"), py::arg("ns"),
     "Make the stream busy for `ns` more nanoseconds after its queued work (torch.supa._sleep)");
  m.def("_event_elapsed_time", &event_elapsed_ms, "Milliseconds between two recorded timing events");
  m.def("_graph_pool_handle", [] {
    const auto id = supa::new_graph_pool_id();
    return pool_id(id.first, id.second);
  });
  m.def("_mem_pool_id", [] {
    const auto id = supa::new_user_pool_id();
    return pool_id(id.first, id.second);
  });
  m.def("_begin_allocate_to_pool", [](int64_t device, std::pair<uint64_t, uint64_t> pool) {
    supa::begin_allocate_to_pool(device_arg(device), pool);
  });
  m.def("_end_allocate_to_pool", [](int64_t device, std::pair<uint64_t, uint64_t> pool) {
    supa::end_allocate_to_pool(device_arg(device), pool);
  });
  m.def("_retain_pool", [](std::pair<uint64_t, uint64_t> pool) { supa::retain_pool(pool); });
  m.def("_set_pool_rules", [](std::pair<uint64_t, uint64_t> pool, bool use_on_oom, bool no_split) {
    supa::set_pool_rules(pool, use_on_oom, no_split);
  });
  m.def("_release_pool", [](std::pair<uint64_t, uint64_t> pool) { return supa::release_pool(pool); });
  m.def("_pool_use_count", [](std::pair<uint64_t, uint64_t> pool) { return supa::pool_use_count(pool); });
  m.def("_exchange_active_pool", [](std::pair<uint64_t, uint64_t> pool) {
    const auto previous = supa::exchange_active_pool(pool);
    return pool_id(previous.first, previous.second);
  });
  m.def("_active_pool", [] {
    const auto pool = supa::active_pool();
    return pool_id(pool.first, pool.second);
  });
  m.def("_release_pool_cache", [](std::pair<uint64_t, uint64_t> pool) {
    supa::device_allocator()->emptyCache(pool);
  });
  m.def("_memcheck_enable", &supa::memcheck_set_enabled, py::arg("enabled"));
  m.def("_memcheck_operands", [](const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) -> py::object {
    const supa::MemcheckFault f = supa::memcheck_operands(reads, writes);
    if (f.kind == supa::MemcheckFault::kNone) {
      return py::none();
    }
    py::object frames = f.site ? symbolize({f.site})[0] : py::none();
    return py::make_tuple(static_cast<int>(f.kind), f.operand, f.lo, f.hi, f.live, f.base, f.first_unwritten, frames);
  }, "None, or the first operand outside its live allocation or reading bytes never written: "
     "(kind, operand, lo, hi, live, base, first_unwritten, allocation frames)");
  m.def("_memcheck_written", &supa::memcheck_written);
  m.def("_memcheck_uninitialized", &supa::memcheck_uninitialized);
  m.def("_memcheck_tracked_blocks", &supa::memcheck_tracked_blocks);
  m.def("_set_memory_history", &set_memory_history, py::arg("recording"), py::arg("context"),
        py::arg("cpp_stacks"), py::arg("max_entries"), py::arg("clear"), py::arg("compile_context"),
        py::arg("global_annotations"), py::arg("skip_actions"));
  m.def("_memory_annotations", &memory_annotations);
  m.def("_set_memory_metadata", &supa::set_memory_metadata, py::arg("metadata"));
  m.def("_memory_metadata", &supa::memory_metadata);
  m.def("_memory_trace", &memory_trace);
}
