// Device memory as PyTorch sees it: the c10 device allocator of `supa`, its statistics,
// settings and snapshots, over the emulated cards' memory (card_memory.h).
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Stream.h>
#include <c10/core/StorageImpl.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace supa {

class BlockTable;
class CardAllocator;

// `lazy_backing`: segments cost host RAM only where written (the planner's shapes mode).
void init_memory(const std::vector<int64_t>& capacities, bool lazy_backing);
c10::DeviceAllocator* device_allocator();
// The allocator of `device` (raises invalid device ordinal), and the table of whose pointer each
// block handed out is: for the allocator's own sources (card_allocator.h, provisional_blocks.cpp).
CardAllocator& card_allocator(c10::DeviceIndex device);
BlockTable& block_table();
// Raises for a request of 1 EiB or more, as CUDA does, before any card is asked.
void check_request_size(size_t nbytes);
// A block handed out or returned, for the GPU trace (see report_blocks_to_gpu_trace).
void report_block_to_gpu_trace(void* ptr, bool allocated);
// A block of `device`'s pool (counted as allocated) and the deleter that gives it back.
void* allocate_block(size_t nbytes, c10::DeviceIndex device);
void free_block(void* ptr);
void delete_device_ptr(void* ptr);  // free_block, accepting nullptr
// The pool of the allocated block that starts at `ptr`; nullopt when no block starts there.
std::optional<c10::MempoolId_t> block_pool(const void* ptr);
// From now on block hand-outs and returns reach the GPU trace (when it is on).
void report_blocks_to_gpu_trace();
// Device of a pointer handed out by the device allocator, or -1.
c10::DeviceIndex device_of_ptr(const void* ptr);
// A block of the caching allocator, looked up by its start (see memcheck.cpp).
struct LiveBlock {
  bool allocated;
  size_t requested;  // the bytes asked for, what an operand may reach
};
std::optional<LiveBlock> live_block(const void* ptr);
void set_memory_fraction(double fraction, c10::DeviceIndex device);
double get_memory_fraction(c10::DeviceIndex device);
// The allocator settings that change accounting; max_split_size < 0 means unlimited;
// `divisions` has one entry per roundup_power2_divisions interval (kRoundUpIntervals);
// `capture_record_stream_reuse`: graph_capture_record_stream_reuse (freed_blocks.h);
// `expandable_segments`: new memory is mapped into expandable segments (expandable_segments.h).
void set_allocator_knobs(int64_t max_split_size, double gc_threshold, const std::vector<int64_t>& divisions,
                         bool capture_record_stream_reuse = false, bool expandable_segments = false);
int64_t capacity(c10::DeviceIndex device);
// A segment and its blocks in address order, for torch.supa.memory._snapshot().
struct BlockInfo {
  uintptr_t address;
  size_t size;
  size_t requested;  // what its (last) caller asked for
  bool allocated;
  bool active;  // allocated, or freed but not yet reusable (streams that used it have not passed the free)
};
struct SegmentInfo {
  int device;
  uintptr_t address;
  size_t total_size;
  size_t allocated_size;
  size_t active_size;  // allocated, and freed but not yet reusable
  size_t requested_size;
  bool small;
  std::pair<unsigned long long, unsigned long long> pool;  // (graph pool, user pool)
  int64_t stream;  // the stream whose requests its blocks serve
  std::vector<BlockInfo> blocks;
  bool expandable = false;  // a mapped range of an expandable segment (one entry per range)
};
// The segments of `device` (every device's when it is negative), by device and address.
std::vector<SegmentInfo> segment_snapshot(c10::DeviceIndex device);
void* raw_alloc(size_t nbytes, c10::DeviceIndex device);
void raw_delete(void* ptr);

}  // namespace supa
