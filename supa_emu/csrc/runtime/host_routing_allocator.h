// Host allocations routed to a device pool while an operator fallback runs a CPU kernel.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/StorageImpl.h>

namespace supa {

// While alive on a thread, host (CPU) allocations of that thread come from the given
// device's pool, provisionally (provisional_blocks.h). The operator fallback uses it so that the
// outputs CPU kernels allocate already live in device memory and can be handed back without a
// copy. A negative device sends them to the host. `take_from_card`: each allocation is a free
// block of the card where one fits (allocate_provisional's from_card), so that results need no
// copy; for a CPU kernel's call only (nothing else may place on the card meanwhile).
class DeviceOutputScope {
 public:
  explicit DeviceOutputScope(c10::DeviceIndex device, bool take_from_card = false);
  ~DeviceOutputScope();
  DeviceOutputScope(const DeviceOutputScope&) = delete;
  DeviceOutputScope& operator=(const DeviceOutputScope&) = delete;

  // Where this thread's host allocations go (one thread-local, read once per allocation).
  struct Routing {
    c10::DeviceIndex device = -1;
    bool take_from_card = false;
  };

 private:
  Routing previous_;
};
void install_host_routing_allocator();
// The planner's bound on host memory: from now on a host (CPU) allocation made outside an operator
// kernel that would take the live ones past `bytes` raises, naming the model built on host tensors
// it most likely is, instead of the host swapping or killing the process.
void limit_host_tensors(size_t bytes);
// Moves the memory of a host storage into a device DataPtr when that memory came from
// `device`'s pool, and counts it as the card's (commit_block); returns an empty DataPtr (and
// leaves the storage alone) otherwise.
c10::DataPtr take_device_block(c10::StorageImpl* host_storage, c10::DeviceIndex device);

}  // namespace supa
