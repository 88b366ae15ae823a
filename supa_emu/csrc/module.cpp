// Python bindings of the emulated SUPA runtime (`supa_emu.native._C`).
#include "runtime/runtime.h"

#include <torch/csrc/Generator.h>
#include <torch/extension.h>

namespace {

void init(int count, const std::vector<int64_t>& capacities, bool dtype_demotion) {
  supa::init_devices(count, capacities, dtype_demotion);
  supa::install_host_routing_allocator();
  supa::register_hooks();
  supa::register_graph_impl();
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

py::list memory_snapshot(int device) {
  py::list segments;
  for (const auto& fields : supa::segment_snapshot(static_cast<c10::DeviceIndex>(device))) {
    py::dict segment;
    bool small = false;
    for (const auto& field : fields) {
      if (field.first == "is_small") {
        small = field.second != 0;
      } else {
        segment[py::str(field.first)] = field.second;
      }
    }
    const int64_t allocated = segment["allocated_size"].cast<int64_t>();
    segment["active_size"] = allocated;
    segment["stream"] = 0;
    segment["segment_type"] = small ? "small" : "large";
    segment["segment_pool_id"] = py::make_tuple(0, 0);
    segment["is_expandable"] = false;
    segment["frames"] = py::list();
    py::dict block;
    block["address"] = segment["address"];
    block["size"] = segment["total_size"];
    block["requested_size"] = segment["requested_size"];
    block["state"] = allocated > 0 ? "active_allocated" : "inactive";
    block["frames"] = py::list();
    py::list blocks;
    blocks.append(block);
    segment["blocks"] = blocks;
    segments.append(segment);
  }
  return segments;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Native core of the emulated SUPA device";
  m.def("_init", &init, "Create the emulated devices (once per process)");
  m.def("_device_count", [] { return supa::device_count(); });
  m.def("_get_device", [] { return static_cast<int>(supa::current_device()); });
  m.def("_set_device", [](int index) { supa::set_device(static_cast<c10::DeviceIndex>(index)); });
  m.def("_exchange_device",
        [](int index) { return static_cast<int>(supa::exchange_device(static_cast<c10::DeviceIndex>(index))); });
  m.def("_set_memory_fraction", [](double fraction, int device) {
    supa::set_memory_fraction(fraction, static_cast<c10::DeviceIndex>(device));
  });
  m.def("_get_memory_fraction", [](int device) {
    return supa::get_memory_fraction(static_cast<c10::DeviceIndex>(device));
  });
  m.def("_capacity", [](int device) { return supa::capacity(static_cast<c10::DeviceIndex>(device)); });
  m.def("_memory_snapshot", &memory_snapshot, py::arg("device") = -1);
  m.def("_raw_alloc", [](size_t nbytes, int device) {
    return reinterpret_cast<uintptr_t>(supa::raw_alloc(nbytes, static_cast<c10::DeviceIndex>(device)));
  });
  m.def("_raw_delete", [](uintptr_t ptr) { supa::raw_delete(reinterpret_cast<void*>(ptr)); });
  m.def("_host_view", &supa::host_view, "A CPU tensor over a supa tensor's memory (no copy)");
  m.def("_default_generators", &default_generators);
  m.def("_is_current_stream_capturing", [] { return supa::is_capturing(); });
}
