// Routing of host allocations into a device pool while an operator fallback runs a CPU kernel
// (DeviceOutputScope): the process's CPU allocator is replaced by one that passes every request
// through to the allocator it replaced, except on a thread inside a fallback kernel, where the
// kernel's allocations (its outputs, and its scratch) come from the device's pool, provisionally
// (allocate_provisional, provisional_blocks.cpp). The outputs become supa tensors when the fallback
// hands them back (take_device_block), and only then count as the card's: in place when the block
// was taken from the card and the card has not changed since (a kernel's one result), otherwise
// with their bytes moved into a block placed then. The scratch never counts.
#include "host_routing_allocator.h"

#include "caching_allocator.h"
#include "devices.h"
#include "out_of_memory.h"
#include "provisional_blocks.h"

#include <c10/core/CPUAllocator.h>

#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace supa {
namespace {

thread_local DeviceOutputScope::Routing t_routing;
c10::Allocator* g_base_cpu_allocator = nullptr;

// The planner's bound on host tensors (limit_host_tensors): the live host allocations made
// outside operator kernels, by pointer.
struct HostTensorBound {
  std::atomic<size_t> limit{0};  // 0: unbounded, nothing tracked
  std::mutex mutex;
  std::unordered_map<void*, size_t> sizes;
  size_t live = 0;
};
HostTensorBound g_host_bound;

void routed_raw_delete(void* ptr);

c10::DataPtr allocate_bounded_host(size_t nbytes) {
  const size_t limit = g_host_bound.limit.load();
  {
    std::lock_guard<std::mutex> lock(g_host_bound.mutex);
    TORCH_CHECK(g_host_bound.live + nbytes <= limit, "planner: the script holds ", format_size(g_host_bound.live),
                " in host (CPU) tensors and asks for ", format_size(nbytes), " more, beyond the ", format_size(limit),
                " of host memory a planned rank may use (SUPA_PLAN_HOST_MEMORY): a model built on host tensors needs "
                "all of its bytes on the host. Build it where it will live instead: under deepspeed.zero.Init() "
                "(ZeRO-3), or on the meta device and then to_empty(device=...) (FSDP2), or with device= the card");
  }
  void* ptr = g_base_cpu_allocator->raw_allocate(nbytes);
  std::lock_guard<std::mutex> lock(g_host_bound.mutex);
  g_host_bound.sizes.emplace(ptr, nbytes);
  g_host_bound.live += nbytes;
  return {ptr, ptr, &routed_raw_delete, c10::Device(c10::DeviceType::CPU)};
}

void routed_raw_delete(void* ptr) {
  if (drop_provisional(ptr)) {  // a kernel's raw allocation inside a fallback
    return;
  }
  if (g_host_bound.limit.load(std::memory_order_relaxed) != 0) {
    std::lock_guard<std::mutex> lock(g_host_bound.mutex);
    if (auto it = g_host_bound.sizes.find(ptr); it != g_host_bound.sizes.end()) {
      g_host_bound.live -= it->second;
      g_host_bound.sizes.erase(it);
    }
  }
  g_base_cpu_allocator->raw_deleter()(ptr);
}

class HostRoutingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const DeviceOutputScope::Routing routing = t_routing;
    if (routing.device < 0 || nbytes == 0) {
      if (nbytes != 0 && g_host_bound.limit.load(std::memory_order_relaxed) != 0) {
        return allocate_bounded_host(nbytes);
      }
      return g_base_cpu_allocator->allocate(nbytes);
    }
    void* ptr = allocate_provisional(nbytes, routing.device, routing.take_from_card);
    return {ptr, ptr, &delete_provisional, c10::Device(c10::DeviceType::CPU)};
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

DeviceOutputScope::DeviceOutputScope(c10::DeviceIndex device, bool take_from_card)
    : previous_(t_routing) {
  DeviceOutputScope::Routing& routing = t_routing;
  routing = {device, take_from_card && device >= 0};
  if (routing.take_from_card) {
    begin_operator_allocations();
  }
}

DeviceOutputScope::~DeviceOutputScope() {
  t_routing = previous_;
}

c10::DataPtr take_device_block(c10::StorageImpl* host_storage, c10::DeviceIndex device) {
  c10::DataPtr& current = host_storage->_mutable_data_ptr_no_checks();
  if (current.get_deleter() != &delete_provisional) {
    return c10::DataPtr();
  }
  void* committed = commit_block(current.get(), device);
  if (committed == nullptr) {  // another device's
    return c10::DataPtr();
  }
  // The card's block now: the provisional block itself, or the block its bytes moved to (its
  // provisional memory went back with the move).
  host_storage->set_data_ptr(c10::DataPtr()).release_context();
  host_storage->set_nbytes(0);
  return {committed, committed, &delete_device_ptr, c10::Device(kSupa, device)};
}

void limit_host_tensors(size_t bytes) {
  TORCH_CHECK(g_base_cpu_allocator != nullptr && g_base_cpu_allocator->raw_deleter() != nullptr,
              "supa_emu: host tensors can be bounded only over an allocator with a raw deleter");
  g_host_bound.limit.store(bytes);
}

void install_host_routing_allocator() {
  if (g_base_cpu_allocator == nullptr) {
    g_base_cpu_allocator = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&g_routing_allocator, /*priority=*/100);
  }
}

}  // namespace supa
