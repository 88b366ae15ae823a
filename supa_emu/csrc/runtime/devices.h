// The emulated cards this process sees and the current one (per thread, as in CUDA).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DispatchKeySet.h>

#include <cstdint>
#include <vector>

namespace supa {

constexpr c10::DeviceType kSupa = c10::DeviceType::PrivateUse1;
// The dispatch keys of a supa tensor and of a host (CPU) tensor.
constexpr c10::DispatchKeySet kSupaKeys{c10::DispatchKey::PrivateUse1};
constexpr c10::DispatchKeySet kCpuKeys{c10::DispatchKey::CPU};

// Creates the cards (with their memory, one capacity each); once per process. `lazy_backing`:
// card memory costs host RAM only where the host writes it (caching_allocator.h).
void init_devices(int count, const std::vector<int64_t>& capacities, bool dtype_demotion, bool lazy_backing);
int device_count() noexcept;
bool dtype_demotion_enabled();
c10::DeviceIndex current_device();
// Checked: raises the runtime's invalid-device error for an index outside [0, count).
void set_device(c10::DeviceIndex index);
// Takes an index as wide as Python's, so the error names the index given, not its narrowed value.
void check_device_index(int64_t index);
// Makes `index` current and returns the previous device; a negative index changes nothing
// and returns -1 (the convention of torch.cuda._exchange_device).
c10::DeviceIndex exchange_device(c10::DeviceIndex index);

// Makes `device` current for the kernel and restores the previous one; does nothing when it is
// current already (the common case), which saves the guard-registry lookups of c10::DeviceGuard.
class CurrentDeviceScope {
 public:
  explicit CurrentDeviceScope(c10::DeviceIndex device) : previous_(current_device()) {
    if (device != previous_) {
      set_device(device);
    } else {
      previous_ = -1;
    }
  }
  ~CurrentDeviceScope() {
    if (previous_ >= 0) {
      set_device(previous_);
    }
  }
  CurrentDeviceScope(const CurrentDeviceScope&) = delete;
  CurrentDeviceScope& operator=(const CurrentDeviceScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};

}  // namespace supa
