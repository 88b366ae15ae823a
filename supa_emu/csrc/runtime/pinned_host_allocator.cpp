// Pinned host memory (`tensor.pin_memory()` with supa as the accelerator), cached as a card's
// runtime caches it: PyTorch's caching host allocator (ATen/core/CachingHostAllocator.h) keeps
// freed blocks for reuse, with its statistics, `torch.accelerator.empty_host_cache()` and graph
// pools. This file gives it the runtime it asks for: host memory known as pinned (so `is_pinned()`
// answers, also for views into a block), the current supa stream, and events that tell when a
// stream that used a block (a non_blocking copy) has reached the point where the block was freed.
#include "pinned_host_allocator.h"

#include "card_memory.h"
#include "device_guard.h"
#include "devices.h"
#include "graph.h"
#include "stream_timeline.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <map>
#include <mutex>

namespace supa {
namespace {

std::mutex g_pinned_mutex;
std::map<const char*, size_t> g_pinned;  // pinned allocations: start -> size

// A stream's position when a block it used was freed: the block is free once the stream passed it.
struct StreamPoint {
  int64_t ready_ns;
};

using Block = at::HostBlock<c10::Stream>;

class SupaHostAllocatorImpl final : public at::CachingHostAllocatorImpl<c10::Stream, StreamPoint> {
 private:
  void allocate_host_memory(size_t size, void** ptr) override {
    TORCH_CHECK_WITH(OutOfMemoryError, posix_memalign(ptr, kMemoryAlignment, size) == 0,
                     "SUPA out of memory: cannot allocate ", size, " bytes of pinned host memory");
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.emplace(static_cast<const char*>(*ptr), size);
  }
  void free_block(Block* block) override {
    {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.erase(static_cast<const char*>(block->ptr_));
    }
    std::free(block->ptr_);
  }
  void record_stream(std::optional<std::vector<StreamPoint>>& events, c10::Stream stream) override {
    events->push_back({stream_ready_ns(stream.device_index(), stream.id())});
  }
  bool query_event(StreamPoint& event) override {
    return now_ns() >= event.ready_ns;
  }
  c10::Stream get_current_stream() const override {
    const c10::DeviceIndex device = current_device();
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kSupa, device), current_stream_id(device));
  }
  bool stream_is_capturing(c10::Stream stream) const override {
    return is_stream_captured(stream.device_index(), stream.id());
  }
};

void delete_pinned(void* ctx);
struct SupaHostAllocator final : public at::CachingHostAllocatorInterface<SupaHostAllocatorImpl, delete_pinned> {};
SupaHostAllocator g_host_allocator;
void delete_pinned(void* ctx) {
  g_host_allocator.free(ctx);
}

}  // namespace

REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &g_host_allocator)

c10::Allocator* host_allocator() {
  return &g_host_allocator;
}

bool is_pinned_ptr(const void* ptr) {
  const char* p = static_cast<const char*>(ptr);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) {
    return false;
  }
  --it;
  return p < it->first + it->second;
}

void record_pinned_use(const at::Tensor& host, c10::Stream stream) {
  const c10::DataPtr& data = host.storage().data_ptr();
  g_host_allocator.record_event(data.get(), data.get_context(), stream);
}

}  // namespace supa
