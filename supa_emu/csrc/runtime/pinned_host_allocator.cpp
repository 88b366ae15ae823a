// Pinned host memory (`tensor.pin_memory()` with supa as the accelerator): host memory the
// runtime knows as pinned, so `is_pinned()` answers and non_blocking copies can be told apart.
#include "pinned_host_allocator.h"

#include "card_memory.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_set>

namespace supa {
namespace {

std::mutex g_pinned_mutex;
std::unordered_set<const void*> g_pinned;

void delete_pinned(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(ptr);
  }
  std::free(ptr);
}

class PinnedHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nullptr;
    if (nbytes > 0) {
      TORCH_CHECK_WITH(OutOfMemoryError, posix_memalign(&ptr, kMemoryAlignment, nbytes) == 0,
                       "SUPA out of memory: cannot allocate ", nbytes, " bytes of pinned host memory");
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.insert(ptr);
    }
    return {ptr, ptr, &delete_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedHostAllocator g_host_allocator;

}  // namespace

c10::Allocator* host_allocator() {
  return &g_host_allocator;
}

bool is_pinned_ptr(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  return g_pinned.count(ptr) != 0;
}

}  // namespace supa
