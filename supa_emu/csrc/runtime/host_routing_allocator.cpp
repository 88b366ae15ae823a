// Routing of host allocations into a device pool while an operator fallback runs a CPU kernel
// (DeviceOutputScope): the process's CPU allocator is replaced by one that passes every request
// through to the allocator it replaced, except on a thread inside a fallback kernel, where the
// kernel's allocations (its outputs, and its scratch) come from the device's pool. The outputs then
// become supa tensors by relabelling their memory instead of copying it (take_device_block).
#include "host_routing_allocator.h"

#include "caching_allocator.h"
#include "devices.h"

#include <c10/core/CPUAllocator.h>

#include <cstring>

namespace supa {
namespace {

thread_local c10::DeviceIndex t_output_device = -1;
thread_local int t_device_allocations_left = -1;  // -1: every allocation in the scope
c10::Allocator* g_base_cpu_allocator = nullptr;

void routed_raw_delete(void* ptr) {
  if (device_of_ptr(ptr) >= 0) {
    free_block(ptr);
  } else {
    g_base_cpu_allocator->raw_deleter()(ptr);
  }
}

class HostRoutingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (t_output_device < 0 || nbytes == 0 || t_device_allocations_left == 0) {
      return g_base_cpu_allocator->allocate(nbytes);
    }
    if (t_device_allocations_left > 0) {
      --t_device_allocations_left;
    }
    void* ptr = allocate_block(nbytes, t_output_device);
    return {ptr, ptr, &delete_device_ptr, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return g_base_cpu_allocator->raw_deleter() ? &routed_raw_delete : nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

HostRoutingAllocator g_routing_allocator;

}  // namespace

DeviceOutputScope::DeviceOutputScope(c10::DeviceIndex device, int first_allocations)
    : previous_(t_output_device), previous_left_(t_device_allocations_left) {
  t_output_device = device;
  t_device_allocations_left = first_allocations;
}

DeviceOutputScope::~DeviceOutputScope() {
  t_output_device = previous_;
  t_device_allocations_left = previous_left_;
}

c10::DataPtr take_device_block(c10::StorageImpl* host_storage, c10::DeviceIndex device) {
  c10::DataPtr& current = host_storage->_mutable_data_ptr_no_checks();
  if (current.get_deleter() != &delete_device_ptr || device_of_ptr(current.get()) != device) {
    return c10::DataPtr();
  }
  c10::DataPtr taken = host_storage->set_data_ptr(c10::DataPtr());
  host_storage->set_nbytes(0);
  taken.unsafe_set_device(c10::Device(kSupa, device));
  return taken;
}

void install_host_routing_allocator() {
  if (g_base_cpu_allocator == nullptr) {
    g_base_cpu_allocator = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&g_routing_allocator, /*priority=*/100);
  }
}

}  // namespace supa
