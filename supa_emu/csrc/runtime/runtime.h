// The emulated SUPA runtime: devices, memory, generators and graph capture, shared by the
// PyTorch glue (device guard, hooks, operator registrations) and the Python bindings.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace supa {

constexpr c10::DeviceType kSupa = c10::DeviceType::PrivateUse1;

// ---- devices (device_state.cpp) -----------------------------------------------------------
void init_devices(int count, const std::vector<int64_t>& capacities, bool dtype_demotion);
int device_count() noexcept;
bool dtype_demotion_enabled();
c10::DeviceIndex current_device();
// Checked: raises the runtime's invalid-device error for an index outside [0, count).
void set_device(c10::DeviceIndex index);
void check_device_index(c10::DeviceIndex index);
// Makes `index` current and returns the previous device; a negative index changes nothing
// and returns -1 (the convention of torch.cuda._exchange_device).
c10::DeviceIndex exchange_device(c10::DeviceIndex index);
void register_hooks();  // hooks.cpp

// ---- memory (caching_allocator.cpp) -------------------------------------------------------
void init_memory(const std::vector<int64_t>& capacities);
c10::DeviceAllocator* device_allocator();
c10::Allocator* host_allocator();  // pinned host memory
bool is_pinned_ptr(const void* ptr);
// Device of a pointer handed out by the device allocator, or -1.
c10::DeviceIndex device_of_ptr(const void* ptr);
void set_memory_fraction(double fraction, c10::DeviceIndex device);
double get_memory_fraction(c10::DeviceIndex device);
int64_t capacity(c10::DeviceIndex device);
std::vector<std::vector<std::pair<std::string, int64_t>>> segment_snapshot(c10::DeviceIndex device);
void* raw_alloc(size_t nbytes, c10::DeviceIndex device);
void raw_delete(void* ptr);
// Grow or shrink a supa storage in place (keeps the common prefix of the bytes).
void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes);

// While alive on a thread, host (CPU) allocations of that thread come from the given
// device's pool. The operator fallback uses it so that the outputs CPU kernels allocate
// already live in device memory and can be handed back without a copy.
class DeviceOutputScope {
 public:
  explicit DeviceOutputScope(c10::DeviceIndex device);
  ~DeviceOutputScope();
  DeviceOutputScope(const DeviceOutputScope&) = delete;
  DeviceOutputScope& operator=(const DeviceOutputScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};
void install_host_routing_allocator();
// Moves the memory of a host storage into a device DataPtr when that memory came from
// `device`'s pool; returns an empty DataPtr (and leaves the storage alone) otherwise.
c10::DataPtr take_device_block(c10::StorageImpl* host_storage, c10::DeviceIndex device);

// ---- tensors living on both sides (host_alias.cpp) ----------------------------------------
// A CPU tensor over a supa tensor's memory: same sizes, strides and offset, no copy.
at::Tensor host_view(const at::Tensor& device_tensor);
// A supa tensor over `device_storage` with the geometry of `like`.
at::Tensor device_tensor_on(const c10::Storage& device_storage, const at::Tensor& like);
// Turns a CPU result into a supa tensor: takes over its memory when it came from the
// device pool (DeviceOutputScope), copies it otherwise.
// `holders` is how many references to its storage the caller knows of (the storage can be
// taken over only when nothing else holds it).
at::Tensor adopt_host_result(const at::Tensor& cpu, c10::DeviceIndex device, size_t holders = 1);
// A CPU storage over a supa storage's memory (zero copy). While it is alive it keeps the
// supa storage alive. It is resizable: a CPU kernel that grows it gets fresh memory, which
// the operator fallback then moves back into the supa storage.
c10::Storage host_alias_storage(const c10::Storage& device_storage);
at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like);

// ---- generators (generator.cpp) -----------------------------------------------------------
const at::Generator& default_generator(c10::DeviceIndex device);
at::Generator new_generator(c10::DeviceIndex device);
// The CPU generator that backs a supa generator; CPU kernels draw from it.
at::Generator host_generator_of(const at::Generator& supa_generator);

// ---- graph capture (graph.cpp) ------------------------------------------------------------
bool is_capturing();
// Called by kernels while capturing: remembers the call so that replay can run it again.
void record_call(const c10::OperatorHandle& op, const std::vector<c10::IValue>& inputs,
                 const std::vector<c10::IValue>& outputs);
void register_graph_impl();

// ---- operators (fallback.cpp) -------------------------------------------------------------
void route_composite_ops_to_cpu_kernels();

}  // namespace supa
