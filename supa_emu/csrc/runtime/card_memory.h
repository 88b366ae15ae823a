// The emulated card's memory, as the device would manage it: its capacity, the segments it has
// reserved from the host, the cache of freed blocks, and the policy that decides which block
// serves a request. Plain C++ (no PyTorch), so it is unit-tested on its own
// (tests/cpp/card_memory_test.cpp); the statistics, snapshots and the c10 allocator interface
// that mirror PyTorch's CUDA caching allocator are built on it in caching_allocator.cpp.
//
// Blocks are never split and free blocks are never coalesced: a freed block goes back to its
// card's cache whole and serves a later request of the same rounded size (the most recently
// freed first). An oversize block (max_split_size) also serves requests up to kLargeBuffer
// smaller, as the real allocator does since it will not split it.
//
// A segment's host memory comes from the heap, or (Backing::kReservedAddressSpace, the planner's
// shapes mode) for larger segments from reserved address space that costs no host RAM until the
// host writes it; such a block's pages go back to the host when it is cached. Under that backing
// every block place() hands out reads as zeros (fresh or dropped pages; a small block is cleared),
// so what a program reads from memory no kernel wrote does not depend on what was there before.
//
// Not thread-safe: the caller serialises every call (caching_allocator.cpp holds one mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

namespace supa {

constexpr size_t kMemoryAlignment = 64;   // of device blocks and pinned host memory
constexpr size_t kPadding = 32;           // the real allocator pads each request by 32 bytes
constexpr size_t kMinBlockSize = 512;     // and rounds to 512-byte blocks
constexpr size_t kSmallSize = 1 << 20;    // blocks below 1 MiB belong to the small pool
constexpr size_t kLargeBuffer = 20 << 20;  // an oversize block serves requests up to this much smaller
constexpr size_t kRoundUpStart = 1 << 20;  // roundup_power2_divisions intervals start at 1 MiB
// roundup_power2_divisions has one entry per power-of-two interval from 1 MiB (the last is open).
constexpr size_t kRoundUpIntervals = 16;
// More than any card holds: rounding a larger request up would wrap around (a negative size cast
// to size_t is far above it).
constexpr size_t kLargestRequest = size_t{1} << 60;

// Segments of at least this size are backed by reserved address space under kReservedAddressSpace
// (smaller ones share heap pages, which a process touches anyway).
constexpr size_t kReservedBackingMin = 64 << 10;

enum class Backing {
  kHeap,                 // every segment from the heap (posix_memalign): compute mode
  kReservedAddressSpace  // larger segments mapped without reserving host memory: shapes mode
};

// A memory pool's identity: (graph pool n, user pool n); (0, 0) is the card's general pool.
// The same type as c10::MempoolId_t (see mem_pool.cpp).
using PoolId = std::pair<unsigned long long, unsigned long long>;

// The allocator settings that change which blocks are made and reused.
struct BlockPolicy {
  int64_t max_split_size = -1;  // -1: unlimited
  double gc_threshold = 0.0;    // 0: off
  std::vector<size_t> divisions = std::vector<size_t>(kRoundUpIntervals, 0);  // per power of two from 1 MiB

  // The block size that serves a request of `nbytes` (padded, then rounded to 512 bytes or to
  // the interval's roundup_power2_divisions step).
  size_t round_size(size_t nbytes) const;
  bool is_oversize(size_t size) const;
};

struct CardBlock {
  void* ptr;
  size_t size;       // rounded size, what the statistics count
  size_t requested;  // what the caller asked for
  int device;
  bool allocated;
  PoolId pool{0, 0};
  uint64_t freed_at = 0;  // order of the last free on its card, for garbage collection
  bool oversize = false;  // decided when the segment was reserved (max_split_size at that time)
  bool is_segment = true;  // false: host memory backed by the card's backing, not yet a segment (admit)
  bool provisional = false;  // taken by an operator's kernel and not yet handed back as a result
};

// How a request was served (CardMemory::place).
struct Placement {
  CardBlock* block = nullptr;  // null: the request did not fit
  bool from_cache = false;     // a cached block; otherwise a new segment (or none)
  int retries = 0;             // times the whole cache was released to make room
  int host_error = 0;          // the host could not back a segment the card had room for (errno)
};

class CardMemory {
 public:
  // Called for each segment going back to the host, before its memory is freed.
  using SegmentReleased = std::function<void(const CardBlock&)>;

  // The card's segments outlive it (the process's cards live until exit).
  CardMemory(int device, int64_t capacity, SegmentReleased on_release, Backing backing = Backing::kHeap);
  CardMemory(const CardMemory&) = delete;
  CardMemory& operator=(const CardMemory&) = delete;

  int64_t capacity() const { return capacity_; }
  int64_t reserved() const { return reserved_; }
  double fraction() const { return fraction_; }
  void set_fraction(double fraction) { fraction_ = fraction; }
  // What this process may reserve: the capacity times set_per_process_memory_fraction.
  int64_t limit() const;
  // Capacity not reserved (what cudaMemGetInfo reports as free).
  int64_t unreserved() const;
  size_t cached_blocks() const { return cached_.size(); }

  // Serves a request of rounded `size` for `pool`: a cached block if one fits the policy, else a
  // new segment, after garbage collection and, when the card is full, releasing the cache once.
  // The block is returned unmarked (the caller sets allocated and requested).
  Placement place(size_t size, const PoolId& pool, const BlockPolicy& policy);
  // Takes a freed block back into the cache, as the most recently freed.
  void cache(CardBlock* block);

  // Operator kernels' allocations are provisional until the operator hands back its results
  // (caching_allocator.cpp): a cached block taken for one and put back, with its age, when the
  // kernel frees it leaves the cache holding what it held; otherwise the kernel gets host memory
  // of the segment's size that is not yet the card's, which admit() makes a segment.
  CardBlock* take_cached(size_t size, const PoolId& pool, const BlockPolicy& policy);
  void put_back(CardBlock* block);
  // Host memory for a segment of `size` bytes (nullptr when the host has none), and its release.
  void* back(size_t size);
  void unback(void* ptr, size_t size);
  // Makes `block` (is_segment false, memory from back()) a segment of this card, as place() would
  // make a new one: false when the card has no room for it even after releasing its cache.
  bool admit(CardBlock* block, const BlockPolicy& policy, int* retries);
  // Returns the cached blocks (only `pool`'s when given) to the host.
  void release_cached(const PoolId* pool = nullptr);

 private:
  std::multimap<size_t, CardBlock*>::iterator find_cached(size_t size, const PoolId& pool, const BlockPolicy& policy);
  void collect_garbage(size_t incoming, const BlockPolicy& policy);
  bool make_room(size_t size, const BlockPolicy& policy, int* retries);
  void release(CardBlock* block);
  bool lazily_backed(size_t size) const;
  // Under kReservedAddressSpace, clears a heap-backed block (lazily backed ones read zeros anyway).
  void clear_if_reused_heap(CardBlock* block) const;

  int device_;
  int64_t capacity_;
  double fraction_ = 1.0;
  int64_t reserved_ = 0;
  uint64_t frees_ = 0;
  std::multimap<size_t, CardBlock*> cached_;  // free blocks by size
  SegmentReleased on_release_;
  Backing backing_;
};

}  // namespace supa
