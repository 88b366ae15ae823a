// Per-device random generators. Each supa generator owns a CPU generator that holds its
// state: the CPU kernels the operators run on draw from it, so seeding, saving and
// restoring through torch.supa behaves as on a GPU while the numbers come from PyTorch's
// own CPU sampling code.
#include "generator.h"

#include "devices.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <c10/util/Exception.h>

#include <deque>
#include <mutex>

namespace supa {
namespace {

class SupaGenerator final : public c10::GeneratorImpl {
 public:
  SupaGenerator(c10::DeviceIndex device, at::Generator host)
      : c10::GeneratorImpl(c10::Device(kSupa, device), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        host_(std::move(host)) {}

  const at::Generator& host() const {
    return host_;
  }
  void set_current_seed(uint64_t seed) override {
    host_.set_current_seed(seed);
  }
  uint64_t current_seed() const override {
    return host_.current_seed();
  }
  uint64_t seed() override {
    return host_.seed();
  }
  void set_offset(uint64_t offset) override {
    host_.set_offset(offset);
  }
  uint64_t get_offset() const override {
    return host_.get_offset();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    host_.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return host_.unsafeGetGeneratorImpl()->get_state();
  }

 private:
  SupaGenerator* clone_impl() const override {
    return new SupaGenerator(device().index(), host_.clone());
  }
  at::Generator host_;
};

std::mutex g_generators_mutex;
std::deque<at::Generator> g_default_generators;  // deque: references stay valid as it grows

}  // namespace

at::Generator new_generator(c10::DeviceIndex device) {
  return at::make_generator<SupaGenerator>(device, at::make_generator<at::CPUGeneratorImpl>());
}

const at::Generator& default_generator(c10::DeviceIndex device) {
  if (device < 0) {
    device = current_device();
  }
  check_device_index(device);
  std::lock_guard<std::mutex> lock(g_generators_mutex);
  while (g_default_generators.size() <= static_cast<size_t>(device)) {
    auto gen = new_generator(static_cast<c10::DeviceIndex>(g_default_generators.size()));
    gen.set_current_seed(c10::detail::getNonDeterministicRandom());
    g_default_generators.push_back(std::move(gen));
  }
  return g_default_generators[device];
}

at::Generator host_generator_of(const at::Generator& supa_generator) {
  auto* impl = dynamic_cast<SupaGenerator*>(supa_generator.unsafeGetGeneratorImpl());
  TORCH_CHECK(impl != nullptr, "Expected a 'supa' device type for generator but found '",
              supa_generator.device().type(), "'");
  return impl->host();
}

}  // namespace supa
