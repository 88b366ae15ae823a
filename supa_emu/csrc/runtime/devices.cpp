// Device bookkeeping: how many emulated cards this process sees and which one is current.
#include "devices.h"

#include "caching_allocator.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace supa {
namespace {
std::atomic<int> g_device_count{0};
std::atomic<bool> g_dtype_demotion{false};
// Like CUDA, the current device is a per-thread setting.
thread_local c10::DeviceIndex t_current_device = 0;
}  // namespace

void init_devices(int count, const std::vector<int64_t>& capacities, bool dtype_demotion, bool lazy_backing) {
  TORCH_CHECK(count >= 0 && static_cast<size_t>(count) == capacities.size(),
              "supa_emu: one capacity per device expected");
  init_memory(capacities, lazy_backing);
  g_dtype_demotion = dtype_demotion;
  g_device_count = count;
}

int device_count() noexcept {
  return g_device_count.load();
}

bool dtype_demotion_enabled() {
  return g_dtype_demotion.load();
}

c10::DeviceIndex current_device() {
  return t_current_device;
}

void check_device_index(int64_t index) {
  if (index < 0 || index >= device_count()) {
    // The runtime reports a bad ordinal the way CUDA does (cudaErrorInvalidDevice = 101).
    throw c10::AcceleratorError(
        {__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, 101,
        c10::str("SUPA error: invalid device ordinal (device ", index, ", but ",
                 device_count(), " SUPA devices are visible; see SUPA_VISIBLE_DEVICES)"));
  }
}

void set_device(c10::DeviceIndex index) {
  check_device_index(index);
  t_current_device = index;
}

c10::DeviceIndex exchange_device(c10::DeviceIndex index) {
  if (index < 0) {
    return -1;
  }
  const c10::DeviceIndex previous = t_current_device;
  set_device(index);
  return previous;
}

}  // namespace supa
