// The PrivateUse1 hooks: how PyTorch's generic code asks the `supa` backend about
// availability, generators, pinned memory and storage resizing.
#include "hooks.h"

#include "caching_allocator.h"
#include "devices.h"
#include "generator.h"
#include "pinned_host_allocator.h"
#include "storage_resize.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>

namespace supa {
namespace {

struct SupaHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return device_count() > 0;
  }
  void init() const override {}
  const at::Generator& getDefaultGenerator(c10::DeviceIndex device_index) const override {
    return default_generator(device_index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex device_index) const override {
    return new_generator(device_index < 0 ? current_device() : device_index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    const c10::DeviceIndex device = device_of_ptr(data);
    return {kSupa, device < 0 ? current_device() : device};
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }
  c10::Allocator* getPinnedMemoryAllocator() const override {
    return host_allocator();
  }
  bool hasPrimaryContext(c10::DeviceIndex device_index) const override {
    return device_index >= 0 && device_index < device_count();
  }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(device_count());
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_device(device);
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    return device < 0 ? current_device() : exchange_device(device);
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

}  // namespace

void register_hooks() {
  static SupaHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
}

}  // namespace supa
