// Host allocations routed to a device pool while an operator fallback runs a CPU kernel.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

namespace supa {

// While alive on a thread, host (CPU) allocations of that thread come from the given
// device's pool. The operator fallback uses it so that the outputs CPU kernels allocate
// already live in device memory and can be handed back without a copy.
// With `first_allocations` >= 0, only that many (non-empty) allocations go to the device and the
// rest to the host: a kernel that allocates its results first keeps its scratch off the card.
class DeviceOutputScope {
 public:
  explicit DeviceOutputScope(c10::DeviceIndex device, int first_allocations = -1);
  ~DeviceOutputScope();
  DeviceOutputScope(const DeviceOutputScope&) = delete;
  DeviceOutputScope& operator=(const DeviceOutputScope&) = delete;

 private:
  c10::DeviceIndex previous_;
  int previous_left_;
};
void install_host_routing_allocator();
// Moves the memory of a host storage into a device DataPtr when that memory came from
// `device`'s pool; returns an empty DataPtr (and leaves the storage alone) otherwise.
c10::DataPtr take_device_block(c10::StorageImpl* host_storage, c10::DeviceIndex device);

}  // namespace supa
