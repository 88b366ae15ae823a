// Device memory as PyTorch sees it: the c10 device allocator over the emulated cards
// (card_memory.h), with the statistics, settings, snapshots and memory-history events of
// PyTorch's CUDA caching allocator. One block table under one mutex, which the allocation path,
// its statistics, settings and snapshots all read.
//
// An operator kernel's allocations are provisional: the card counts the results the operator hands
// back (commit_block), never the kernel's own scratch (see caching_allocator.h).
//
// A request that does not fit its card even after the card released its cache gets
// torch.OutOfMemoryError with the message shape of the real stack. The allocator settings
// that change accounting act as on the real allocator: roundup_power2_divisions rounds request
// sizes, max_split_size makes large blocks "oversize" (counted apart), and
// garbage_collection_threshold releases the least recently freed cached blocks once reserved
// memory passes that fraction of the card (see BlockPolicy).
#include "caching_allocator.h"

#include "card_memory.h"
#include "devices.h"
#include "gpu_trace.h"
#include "mem_pool.h"
#include "memcheck.h"
#include "memory_history.h"
#include "out_of_memory.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>

namespace supa {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingDeviceAllocator::DeviceStats;

static_assert(std::is_same_v<PoolId, c10::MempoolId_t>, "card_memory.h's PoolId must be c10's pool id");

// A card and the statistics PyTorch keeps for it.
struct DeviceMemory {
  DeviceMemory(c10::DeviceIndex device, int64_t capacity, Backing backing);
  CardMemory card;
  DeviceStats stats;
};

std::mutex g_mutex;
std::vector<std::unique_ptr<DeviceMemory>> g_devices;
std::unordered_map<void*, CardBlock*> g_blocks;  // every block that holds host memory
BlockPolicy g_policy;  // `_set_allocator_settings`

void update(StatArray& stat, size_t size, bool increase) {
  const size_t pool = size < kSmallSize ? 1 : 2;
  for (size_t i : {size_t{0}, pool}) {
    increase ? stat[i].increase(size) : stat[i].decrease(size);
  }
}

DeviceMemory& memory_of(c10::DeviceIndex device) {
  check_device_index(device);
  return *g_devices.at(device);
}

// Count statistics (allocation, segment, active) move by one per block.
void count_block(StatArray& stat, size_t size, bool increase) {
  const size_t pool = size < kSmallSize ? 1 : 2;
  for (size_t i : {size_t{0}, pool}) {
    increase ? stat[i].increase(1) : stat[i].decrease(1);
  }
}

// A segment the card gives back to the host (called by the card, under g_mutex).
void segment_released(DeviceMemory& mem, const CardBlock& block) {
  record_memory_event("segment_free", static_cast<c10::DeviceIndex>(block.device), block.ptr, block.size, nullptr);
  count_block(mem.stats.segment, block.size, false);
  update(mem.stats.reserved_bytes, block.size, false);
  if (block.oversize) {
    mem.stats.oversize_segments.decrease(1);
  }
  mem.stats.num_device_free++;
  g_blocks.erase(block.ptr);
}

DeviceMemory::DeviceMemory(c10::DeviceIndex device, int64_t capacity, Backing backing)
    : card(device, capacity, [this](const CardBlock& block) { segment_released(*this, block); }, backing) {}

// `stack`: the request's, kept with the history's "oom" event (the planner reports where it failed).
[[noreturn]] void raise_oom(DeviceMemory& mem, c10::DeviceIndex device, size_t size,
                            const std::shared_ptr<torch::CapturedTraceback>& stack) {
  mem.stats.num_ooms++;
  record_memory_event("oom", device, nullptr, size, stack);
  throw_card_oom(mem.card, device, size, mem.stats.allocated_bytes[0].current);
}

[[noreturn]] void raise_host_oom(DeviceMemory& mem, c10::DeviceIndex device, size_t size, int error) {
  mem.stats.num_ooms++;
  throw_host_oom(mem.card, device, size, error);
}

// Block hand-outs and returns, for the GPU trace (see gpu_trace.h), once a callback listens for them:
// with the trace on for a sanitizer alone, allocations do not call into Python.
std::atomic<bool> g_report_blocks{false};

void report_block(void* ptr, bool allocated) {
  if (!g_report_blocks.load(std::memory_order_relaxed)) {
    return;
  }
  report_to_gpu_trace([&](const auto& trace) {
    const auto address = reinterpret_cast<uintptr_t>(ptr);
    if (allocated) {
      trace->trace_gpu_memory_allocation(kSupa, address);
    } else {
      trace->trace_gpu_memory_deallocation(kSupa, address);
    }
  });
}

// A provisional block freed before its operator handed it back (the kernel's scratch): back to the
// host, or to the cache it was taken from; the card's figures never saw it. False for other blocks.
bool drop_provisional(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(ptr);
  if (it == g_blocks.end() || !it->second->provisional) {
    return false;
  }
  CardBlock* block = it->second;
  CardMemory& card = g_devices.at(block->device)->card;
  block->provisional = false;
  if (block->is_segment) {
    card.put_back(block);
  } else {
    g_blocks.erase(it);
    card.unback(block->ptr, block->size);
    delete block;
  }
  return true;
}

}  // namespace

void free_block(void* ptr) {
  if (drop_provisional(ptr)) {
    return;
  }
  report_block(ptr, false);
  memcheck_block_freed(ptr);
  const auto stack = memory_event_stack();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(ptr);
  TORCH_INTERNAL_ASSERT(it != g_blocks.end(), "supa_emu: freeing unknown device pointer");
  CardBlock* block = it->second;
  DeviceMemory& mem = *g_devices.at(block->device);
  const auto device = static_cast<c10::DeviceIndex>(block->device);
  count_block(mem.stats.allocation, block->size, false);
  count_block(mem.stats.active, block->size, false);
  update(mem.stats.allocated_bytes, block->size, false);
  update(mem.stats.active_bytes, block->size, false);
  update(mem.stats.requested_bytes, block->requested, false);
  if (block->oversize) {
    mem.stats.oversize_allocations.decrease(1);
  }
  const size_t size = block->size;
  mem.card.cache(block);
  record_memory_event("free_requested", device, ptr, size, stack);
  record_memory_event("free_completed", device, ptr, size, stack);
}

void delete_device_ptr(void* ptr) {
  if (ptr != nullptr) {
    free_block(ptr);
  }
}

namespace {

using Stack = std::shared_ptr<torch::CapturedTraceback>;

// The block size that serves a request; raises for a request no card could hold.
size_t block_size(size_t nbytes, c10::DeviceIndex device) {
  if (nbytes > kLargestRequest) {
    const auto stack = memory_event_stack();
    std::lock_guard<std::mutex> lock(g_mutex);
    raise_oom(memory_of(device), device, nbytes, stack);
  }
  return g_policy.round_size(nbytes);
}

// A new segment of the card (under g_mutex).
void count_segment(DeviceMemory& mem, c10::DeviceIndex device, CardBlock* block, const Stack& stack) {
  g_blocks[block->ptr] = block;
  record_memory_event("segment_alloc", device, block->ptr, block->size, stack);
  mem.stats.num_device_alloc++;
  count_block(mem.stats.segment, block->size, true);
  update(mem.stats.reserved_bytes, block->size, true);
  if (block->oversize) {
    mem.stats.oversize_segments.increase(1);
  }
}

// A block handed out for a request of `nbytes` (under g_mutex).
void count_allocation(DeviceMemory& mem, c10::DeviceIndex device, CardBlock* block, size_t nbytes,
                      const Stack& stack) {
  block->allocated = true;
  block->requested = nbytes;
  count_block(mem.stats.allocation, block->size, true);
  count_block(mem.stats.active, block->size, true);
  update(mem.stats.allocated_bytes, block->size, true);
  update(mem.stats.active_bytes, block->size, true);
  update(mem.stats.requested_bytes, nbytes, true);
  if (block->oversize) {
    mem.stats.oversize_allocations.increase(1);
  }
  record_memory_event("alloc", device, block->ptr, block->size, stack);
}

// The block that serves a request (under g_mutex): cached, or a new segment; raises when none fits.
CardBlock* place_block(DeviceMemory& mem, c10::DeviceIndex device, size_t size, const c10::MempoolId_t& pool,
                       const Stack& stack) {
  const Placement placed = mem.card.place(size, pool, g_policy);
  mem.stats.num_alloc_retries += placed.retries;
  if (placed.block == nullptr) {
    if (placed.host_error != 0) {
      raise_host_oom(mem, device, size, placed.host_error);
    }
    raise_oom(mem, device, size, stack);
  }
  if (!placed.from_cache) {
    count_segment(mem, device, placed.block, stack);
  }
  return placed.block;
}

void* hand_out_block(size_t nbytes, c10::DeviceIndex device) {
  const size_t size = block_size(nbytes, device);
  const auto stack = memory_event_stack();
  const c10::MempoolId_t pool = allocation_pool(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceMemory& mem = memory_of(device);
  CardBlock* block = place_block(mem, device, size, pool, stack);
  count_allocation(mem, device, block, nbytes, stack);
  return block->ptr;
}

}  // namespace

void report_blocks_to_gpu_trace() {
  g_report_blocks.store(true);
}

void* allocate_block(size_t nbytes, c10::DeviceIndex device) {
  void* ptr = hand_out_block(nbytes, device);
  report_block(ptr, true);
  return ptr;
}

void* allocate_provisional(size_t nbytes, c10::DeviceIndex device) {
  const size_t size = block_size(nbytes, device);
  const c10::MempoolId_t pool = allocation_pool(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceMemory& mem = memory_of(device);
  CardBlock* block = mem.card.take_cached(size, pool, g_policy);
  if (block == nullptr) {
    void* ptr = mem.card.back(size);
    if (ptr == nullptr) {
      raise_host_oom(mem, device, size, errno);
    }
    block = new CardBlock{ptr, size, 0, static_cast<int>(device), false, pool};
    block->is_segment = false;
    g_blocks.emplace(ptr, block);
  }
  block->provisional = true;
  block->requested = nbytes;
  return block->ptr;
}

void* commit_block(void* ptr) {
  const auto stack = memory_event_stack();
  void* committed = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.find(ptr);
    TORCH_INTERNAL_ASSERT(it != g_blocks.end(), "supa_emu: committing unknown device pointer");
    CardBlock* block = it->second;
    if (!block->provisional) {
      return ptr;
    }
    const auto device = static_cast<c10::DeviceIndex>(block->device);
    DeviceMemory& mem = memory_of(device);
    CardBlock* serving = block;
    if (!block->is_segment) {
      // As a request made now: a cached block that fits (the bytes move into it), else a new segment.
      serving = mem.card.take_cached(block->size, block->pool, g_policy);
      if (serving != nullptr) {
        std::memcpy(serving->ptr, block->ptr, block->requested);
      } else {
        int retries = 0;
        const bool fits = mem.card.admit(block, g_policy, &retries);
        mem.stats.num_alloc_retries += retries;
        if (!fits) {
          raise_oom(mem, device, block->size, stack);
        }
        serving = block;
        count_segment(mem, device, block, stack);
      }
    }
    serving->provisional = false;  // where the bytes moved, `block` stays provisional: its owner drops it
    count_allocation(mem, device, serving, block->requested, stack);
    committed = serving->ptr;
  }
  report_block(committed, true);
  return committed;
}

namespace {

template <typename Fn>
void for_each_stat(DeviceStats& s, Fn fn) {
  for (StatArray* arr : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                         &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes, &s.requested_bytes}) {
    for (Stat& stat : *arr) {
      fn(stat);
    }
  }
  fn(s.oversize_allocations);
  fn(s.oversize_segments);
}

class SupaDeviceAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    if (nbytes == 0) {
      return {nullptr, nullptr, &delete_device_ptr, c10::Device(kSupa, device)};
    }
    void* ptr = allocate_block(nbytes, device);
    return {ptr, ptr, &delete_device_ptr, c10::Device(kSupa, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &delete_device_ptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool initialized() override {
    return device_count() > 0;
  }
  void emptyCache(c10::MempoolId_t pool) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    const bool general = pool.first == 0 && pool.second == 0;
    for (auto& mem : g_devices) {
      mem->card.release_cached(general ? nullptr : &pool);
    }
  }
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {
    // Execution is synchronous, so a block is never in use by a stream after it is freed.
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    return memory_of(device).stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceStats& s = memory_of(device).stats;
    for_each_stat(s, [](Stat& stat) { stat.reset_accumulated(); });
    s.num_alloc_retries = 0;
    s.num_ooms = 0;
    s.num_sync_all_streams = 0;
    s.num_device_alloc = 0;
    s.num_device_free = 0;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    for_each_stat(memory_of(device).stats, [](Stat& stat) { stat.reset_peak(); });
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceMemory& mem = memory_of(device);
    return {static_cast<size_t>(mem.card.unreserved()), static_cast<size_t>(mem.card.capacity())};
  }
};

SupaDeviceAllocator g_device_allocator;

}  // namespace

void init_memory(const std::vector<int64_t>& capacities, bool lazy_backing) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(g_devices.empty(), "supa_emu: the emulated devices are already initialised");
  const Backing backing = lazy_backing ? Backing::kReservedAddressSpace : Backing::kHeap;
  for (int64_t capacity : capacities) {
    auto mem = std::make_unique<DeviceMemory>(static_cast<c10::DeviceIndex>(g_devices.size()), capacity, backing);
    mem->stats.max_split_size = g_policy.max_split_size;
    g_devices.push_back(std::move(mem));
  }
  c10::SetAllocator(kSupa, &g_device_allocator);
}

c10::DeviceAllocator* device_allocator() {
  return &g_device_allocator;
}

c10::DeviceIndex device_of_ptr(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(const_cast<void*>(ptr));
  return it == g_blocks.end() ? -1 : static_cast<c10::DeviceIndex>(it->second->device);
}

std::optional<LiveBlock> live_block(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(const_cast<void*>(ptr));
  if (it == g_blocks.end()) {
    return std::nullopt;
  }
  return LiveBlock{it->second->allocated, it->second->requested};
}

void set_memory_fraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "Invalid fraction value: ", fraction, ". Allowed range: 0~1");
  std::lock_guard<std::mutex> lock(g_mutex);
  memory_of(device).card.set_fraction(fraction);
}

double get_memory_fraction(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return memory_of(device).card.fraction();
}

void set_allocator_knobs(int64_t max_split_size, double gc_threshold, const std::vector<int64_t>& divisions) {
  TORCH_CHECK(divisions.size() == kRoundUpIntervals, "supa_emu: expected ", kRoundUpIntervals,
              " roundup_power2_divisions intervals, got ", divisions.size());
  std::lock_guard<std::mutex> lock(g_mutex);
  // Blocks keep the oversize status they were created with, so the counters stay balanced.
  g_policy.max_split_size = max_split_size < 0 ? -1 : max_split_size;
  g_policy.gc_threshold = gc_threshold;
  for (size_t i = 0; i < kRoundUpIntervals; ++i) {
    g_policy.divisions[i] = static_cast<size_t>(divisions[i]);
  }
  for (auto& mem : g_devices) {
    mem->stats.max_split_size = g_policy.max_split_size;
  }
}

int64_t capacity(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return memory_of(device).card.capacity();
}

std::vector<std::vector<std::pair<std::string, int64_t>>> segment_snapshot(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::vector<std::pair<std::string, int64_t>>> out;
  for (const auto& entry : g_blocks) {
    const CardBlock* b = entry.second;
    if (!b->is_segment || (device >= 0 && b->device != device)) {
      continue;
    }
    out.push_back({{"device", b->device},
                   {"address", static_cast<int64_t>(reinterpret_cast<uintptr_t>(b->ptr))},
                   {"total_size", static_cast<int64_t>(b->size)},
                   {"allocated_size", b->allocated ? static_cast<int64_t>(b->size) : 0},
                   {"requested_size", b->allocated ? static_cast<int64_t>(b->requested) : 0},
                   {"is_small", b->size < kSmallSize ? 1 : 0},
                   {"pool_graph_id", static_cast<int64_t>(b->pool.first)},
                   {"pool_user_id", static_cast<int64_t>(b->pool.second)}});
  }
  return out;
}

void* raw_alloc(size_t nbytes, c10::DeviceIndex device) {
  return nbytes == 0 ? nullptr : allocate_block(nbytes, device);
}

void raw_delete(void* ptr) {
  delete_device_ptr(ptr);
}

void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  const c10::DeviceIndex device = storage->device().index();
  c10::DataPtr fresh;
  if (nbytes == 0) {
    fresh = c10::DataPtr(nullptr, nullptr, &delete_device_ptr, c10::Device(kSupa, device));
  } else {
    void* ptr = allocate_block(nbytes, device);
    fresh = c10::DataPtr(ptr, ptr, &delete_device_ptr, c10::Device(kSupa, device));
    const size_t keep = std::min(nbytes, storage->nbytes());
    if (keep > 0 && storage->data() != nullptr) {
      std::memcpy(ptr, storage->data(), keep);
    }
    memcheck_resized(storage->data(), ptr, storage->data() != nullptr ? keep : 0, nbytes);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

}  // namespace supa
