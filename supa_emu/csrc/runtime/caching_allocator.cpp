// Device memory: a caching allocator over host memory with per-card capacity and the
// statistics of PyTorch's CUDA caching allocator (one block table under one mutex, which the
// allocation path, its statistics, settings and snapshots all read: hence one file of ~500 lines).
//
// Blocks are never split: a freed block goes to its device's cache and is reused by a
// request of the same rounded size (the most recently freed first). When a request would
// exceed the card's capacity the cache is released and the request retried once; if it still
// does not fit, the caller gets torch.OutOfMemoryError with the message shape of the real stack.
//
// The allocator settings that change accounting act as on the real allocator (see
// AllocatorKnobs): roundup_power2_divisions rounds request sizes, max_split_size makes large
// blocks "oversize" (counted apart, reused by requests up to 20 MiB smaller), and
// garbage_collection_threshold releases the least recently freed cached blocks once reserved
// memory passes that fraction of the card.
#include "runtime.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace supa {
namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kPadding = 32;             // the real allocator pads each request by 32 bytes
constexpr size_t kMinBlockSize = 512;       // and rounds to 512-byte blocks
constexpr size_t kSmallSize = 1 << 20;      // blocks below 1 MiB belong to the small pool
constexpr size_t kLargeBuffer = 20 << 20;   // an oversize block serves requests up to this much smaller
constexpr size_t kRoundUpStart = 1 << 20;   // roundup_power2_divisions intervals start at 1 MiB
constexpr size_t kLargestRequest = size_t{1} << 60;  // (a negative size cast to size_t is far above it)

// Allocator settings that change what is reserved and counted (`_set_allocator_settings`).
struct AllocatorKnobs {
  int64_t max_split_size = -1;                      // -1: unlimited, as memory_stats() reports it
  double gc_threshold = 0.0;                        // 0: off
  std::vector<size_t> divisions = std::vector<size_t>(kRoundUpIntervals, 0);  // per power of two from 1 MiB
};

struct Block {
  void* ptr;
  size_t size;       // rounded size, what the statistics count
  size_t requested;  // what the caller asked for
  c10::DeviceIndex device;
  bool allocated;
  c10::MempoolId_t pool{0, 0};  // see mem_pool.cpp
  uint64_t freed_at = 0;        // order of the last free, for garbage collection
  bool oversize = false;        // counted as oversize when created (max_split_size at that time)
};

struct DeviceMemory {
  int64_t capacity = 0;
  double fraction = 1.0;
  int64_t reserved = 0;
  std::multimap<size_t, Block*> cached;  // free blocks by size
  DeviceStats stats;
};

std::mutex g_mutex;
std::vector<std::unique_ptr<DeviceMemory>> g_devices;
std::unordered_map<void*, Block*> g_blocks;  // every block that holds host memory
AllocatorKnobs g_knobs;
uint64_t g_free_counter = 0;

size_t divisions_for(size_t size) {
  size_t interval = 0;
  while (interval + 1 < kRoundUpIntervals && (kRoundUpStart << (interval + 1)) <= size) {
    ++interval;
  }
  return g_knobs.divisions[interval];
}

// The next of `divisions` equal steps between the powers of two around `size`.
size_t round_to_division(size_t size, size_t divisions) {
  size_t floor = 1;
  while ((floor << 1) <= size) {
    floor <<= 1;
  }
  if (floor == size) {
    return size;
  }
  const size_t step = floor / divisions;
  if (step == 0) {
    return floor << 1;
  }
  return ((size + step - 1) / step) * step;
}

size_t round_size(size_t n) {
  const size_t padded = n + kPadding;
  const size_t divisions = divisions_for(padded);
  if (divisions > 1 && padded > kMinBlockSize * divisions) {
    return round_to_division(padded, divisions);
  }
  return ((padded + kMinBlockSize - 1) / kMinBlockSize) * kMinBlockSize;
}

bool is_oversize(size_t size) {
  return g_knobs.max_split_size >= 0 && size >= static_cast<size_t>(g_knobs.max_split_size);
}

void update(StatArray& stat, size_t size, bool increase) {
  const size_t pool = size < kSmallSize ? 1 : 2;
  for (size_t i : {size_t{0}, pool}) {
    increase ? stat[i].increase(size) : stat[i].decrease(size);
  }
}

std::string format_size(uint64_t size) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed;
  if (size <= 1024) {
    os << size << " bytes";
  } else if (size <= 1048576) {
    os << (static_cast<double>(size) / 1024.0) << " KiB";
  } else if (size <= 1073741824ULL) {
    os << (static_cast<double>(size) / 1048576.0) << " MiB";
  } else {
    os << (static_cast<double>(size) / 1073741824.0) << " GiB";
  }
  return os.str();
}

DeviceMemory& memory_of(c10::DeviceIndex device) {
  check_device_index(device);
  return *g_devices.at(device);
}

int64_t limit_of(const DeviceMemory& mem) {
  return static_cast<int64_t>(mem.fraction * static_cast<double>(mem.capacity));
}

// Count statistics (allocation, segment, active) move by one per block.
void count_block(StatArray& stat, size_t size, bool increase) {
  const size_t pool = size < kSmallSize ? 1 : 2;
  for (size_t i : {size_t{0}, pool}) {
    increase ? stat[i].increase(1) : stat[i].decrease(1);
  }
}

// Gives a cached block's memory back to the host. Caller holds g_mutex.
void return_to_host(DeviceMemory& mem, Block* block) {
  record_memory_event("segment_free", block->device, block->ptr, block->size, nullptr);
  count_block(mem.stats.segment, block->size, false);
  update(mem.stats.reserved_bytes, block->size, false);
  if (block->oversize) {
    mem.stats.oversize_segments.decrease(1);
  }
  mem.reserved -= static_cast<int64_t>(block->size);
  mem.stats.num_device_free++;
  g_blocks.erase(block->ptr);
  std::free(block->ptr);
  delete block;
}

// Returns the device's cached blocks (only `pool`'s when given) to the host. Caller holds g_mutex.
void release_cached(DeviceMemory& mem, const c10::MempoolId_t* pool = nullptr) {
  for (auto it = mem.cached.begin(); it != mem.cached.end();) {
    Block* block = it->second;
    if (pool != nullptr && block->pool != *pool) {
      ++it;
      continue;
    }
    it = mem.cached.erase(it);
    return_to_host(mem, block);
  }
}

// Garbage collection: once reserved memory passes the threshold's share of the card, cached
// blocks go back to the host, least recently freed first, until it is below again.
void collect_garbage(DeviceMemory& mem, size_t incoming) {
  const auto target = static_cast<int64_t>(g_knobs.gc_threshold * static_cast<double>(limit_of(mem)));
  if (g_knobs.gc_threshold <= 0.0 || mem.reserved + static_cast<int64_t>(incoming) <= target) {
    return;
  }
  std::vector<std::multimap<size_t, Block*>::iterator> by_age;
  for (auto it = mem.cached.begin(); it != mem.cached.end(); ++it) {
    by_age.push_back(it);
  }
  std::sort(by_age.begin(), by_age.end(), [](const auto& a, const auto& b) {
    return a->second->freed_at < b->second->freed_at;
  });
  for (auto it : by_age) {
    if (mem.reserved + static_cast<int64_t>(incoming) <= target) {
      break;
    }
    Block* block = it->second;
    mem.cached.erase(it);
    return_to_host(mem, block);
  }
}

[[noreturn]] void raise_oom(DeviceMemory& mem, c10::DeviceIndex device, size_t size) {
  mem.stats.num_ooms++;
  const int64_t allocated = mem.stats.allocated_bytes[0].current;
  const int64_t free_bytes = std::max<int64_t>(0, mem.capacity - mem.reserved);
  std::ostringstream msg;
  msg << "SUPA out of memory. Tried to allocate " << format_size(size) << ". GPU "
      << static_cast<int>(device) << " has a total capacity of " << format_size(mem.capacity)
      << " of which " << format_size(free_bytes) << " is free. ";
  if (mem.fraction < 1.0) {
    msg << "This process is limited to " << format_size(limit_of(mem))
        << " by set_per_process_memory_fraction. ";
  }
  record_memory_event("oom", device, nullptr, size, nullptr);
  msg << "Of the allocated memory " << format_size(allocated)
      << " is allocated by PyTorch, and " << format_size(mem.reserved - allocated)
      << " is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
         "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
         "See documentation for Memory Management  "
         "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)";
  TORCH_CHECK_WITH(OutOfMemoryError, false, msg.str());
}

// The host could not back a block the card had room for: say so, with the host's numbers, instead
// of a card OOM whose "free" figure contradicts it. Still an OutOfMemoryError, so code that
// recovers from OOM (smaller batch, empty_cache) keeps working.
[[noreturn]] void raise_host_oom(DeviceMemory& mem, c10::DeviceIndex device, size_t size, int error) {
  mem.stats.num_ooms++;
  std::ostringstream msg;
  msg << "SUPA emulator: the host could not provide " << format_size(size) << " of memory for an allocation on "
      << "supa:" << static_cast<int>(device) << " (" << std::strerror(error) << "). The emulated card has "
      << format_size(std::max<int64_t>(0, limit_of(mem) - mem.reserved))
      << " of its capacity free, but its memory is this host's memory: lower SUPA_EMU_MEMORY to what the host can "
         "hold, or free host memory.";
  TORCH_CHECK_WITH(OutOfMemoryError, false, msg.str());
}

// Block hand-outs and returns, for the GPU trace (see runtime.h), once a callback listens for them:
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

}  // namespace

void free_block(void* ptr) {
  report_block(ptr, false);
  memcheck_block_freed(ptr);
  const auto stack = memory_event_stack();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_blocks.find(ptr);
  TORCH_INTERNAL_ASSERT(it != g_blocks.end(), "supa_emu: freeing unknown device pointer");
  Block* block = it->second;
  DeviceMemory& mem = *g_devices.at(block->device);
  block->allocated = false;
  count_block(mem.stats.allocation, block->size, false);
  count_block(mem.stats.active, block->size, false);
  update(mem.stats.allocated_bytes, block->size, false);
  update(mem.stats.active_bytes, block->size, false);
  update(mem.stats.requested_bytes, block->requested, false);
  if (block->oversize) {
    mem.stats.oversize_allocations.decrease(1);
  }
  block->freed_at = ++g_free_counter;
  mem.cached.emplace(block->size, block);
  record_memory_event("free_requested", block->device, ptr, block->size, stack);
  record_memory_event("free_completed", block->device, ptr, block->size, stack);
}

void delete_device_ptr(void* ptr) {
  if (ptr != nullptr) {
    free_block(ptr);
  }
}

namespace {

// The cached block that serves a request, if any: of the request's size, the most recently freed
// one, whose memory is the likeliest to be in the CPU's caches still (taking the oldest made a
// convolution on supa 10% slower than on CPU tensors, where malloc hands back the freshest memory).
// An oversize request may also take an oversize block up to kLargeBuffer larger, as the real
// allocator does since it will not split it.
std::multimap<size_t, Block*>::iterator find_cached(DeviceMemory& mem, size_t size, const c10::MempoolId_t& pool) {
  const auto [same_size, larger] = mem.cached.equal_range(size);
  for (auto it = larger; it != same_size;) {
    if ((--it)->second->pool == pool) {
      return it;
    }
  }
  if (is_oversize(size)) {
    for (auto it = larger; it != mem.cached.end() && it->first < size + kLargeBuffer; ++it) {
      if (it->second->pool == pool) {
        return it;
      }
    }
  }
  return mem.cached.end();
}

void* hand_out_block(size_t nbytes, c10::DeviceIndex device) {
  if (nbytes > kLargestRequest) {  // more than any card holds; rounding it up would wrap around
    std::lock_guard<std::mutex> lock(g_mutex);
    raise_oom(memory_of(device), device, nbytes);
  }
  const size_t size = round_size(nbytes);
  const auto stack = memory_event_stack();
  const c10::MempoolId_t pool = allocation_pool(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceMemory& mem = memory_of(device);
  Block* block = nullptr;
  if (auto hit = find_cached(mem, size, pool); hit != mem.cached.end()) {
    block = hit->second;
    mem.cached.erase(hit);
  } else {
    collect_garbage(mem, size);
    if (mem.reserved + static_cast<int64_t>(size) > limit_of(mem) && !mem.cached.empty()) {
      mem.stats.num_alloc_retries++;
      release_cached(mem);
    }
    if (mem.reserved + static_cast<int64_t>(size) > limit_of(mem)) {
      raise_oom(mem, device, size);
    }
    void* ptr = nullptr;
    if (const int error = posix_memalign(&ptr, kMemoryAlignment, size); error != 0) {
      if (!mem.cached.empty()) {  // cached blocks hold host memory too: give it back and retry once
        mem.stats.num_alloc_retries++;
        release_cached(mem);
      }
      if (ptr == nullptr && posix_memalign(&ptr, kMemoryAlignment, size) != 0) {
        raise_host_oom(mem, device, size, error);
      }
    }
    block = new Block{ptr, size, 0, device, false, pool};
    g_blocks.emplace(ptr, block);
    record_memory_event("segment_alloc", device, ptr, size, stack);
    mem.reserved += static_cast<int64_t>(size);
    mem.stats.num_device_alloc++;
    count_block(mem.stats.segment, size, true);
    update(mem.stats.reserved_bytes, size, true);
    block->oversize = is_oversize(size);
    if (block->oversize) {
      mem.stats.oversize_segments.increase(1);
    }
  }
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
      release_cached(*mem, general ? nullptr : &pool);
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
    return {static_cast<size_t>(std::max<int64_t>(0, mem.capacity - mem.reserved)),
            static_cast<size_t>(mem.capacity)};
  }
};

SupaDeviceAllocator g_device_allocator;

}  // namespace

void init_memory(const std::vector<int64_t>& capacities) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(g_devices.empty(), "supa_emu: the emulated devices are already initialised");
  for (int64_t capacity : capacities) {
    auto mem = std::make_unique<DeviceMemory>();
    mem->capacity = capacity;
    mem->stats.max_split_size = g_knobs.max_split_size;
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
  return it == g_blocks.end() ? -1 : it->second->device;
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
  memory_of(device).fraction = fraction;
}

double get_memory_fraction(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return memory_of(device).fraction;
}

void set_allocator_knobs(int64_t max_split_size, double gc_threshold, const std::vector<int64_t>& divisions) {
  TORCH_CHECK(divisions.size() == kRoundUpIntervals, "supa_emu: expected ", kRoundUpIntervals,
              " roundup_power2_divisions intervals, got ", divisions.size());
  std::lock_guard<std::mutex> lock(g_mutex);
  // Blocks keep the oversize status they were created with, so the counters stay balanced.
  g_knobs.max_split_size = max_split_size < 0 ? -1 : max_split_size;
  g_knobs.gc_threshold = gc_threshold;
  for (size_t i = 0; i < kRoundUpIntervals; ++i) {
    g_knobs.divisions[i] = static_cast<size_t>(divisions[i]);
  }
  for (auto& mem : g_devices) {
    mem->stats.max_split_size = g_knobs.max_split_size;
  }
}

int64_t capacity(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return memory_of(device).capacity;
}

std::vector<std::vector<std::pair<std::string, int64_t>>> segment_snapshot(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::vector<std::pair<std::string, int64_t>>> out;
  for (const auto& entry : g_blocks) {
    const Block* b = entry.second;
    if (device >= 0 && b->device != device) {
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
