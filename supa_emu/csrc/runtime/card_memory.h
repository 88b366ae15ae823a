// The emulated card's memory, as the device would manage it: its capacity, the segments it has
// reserved from the host, the free blocks cached in them, and the policy that decides which block
// serves a request. Plain C++ (no PyTorch), so it is unit-tested on its own
// (tests/cpp/card_memory_test.cpp); the statistics and snapshots that mirror PyTorch's CUDA
// caching allocator are built on it in card_allocator.cpp, the c10 allocator in caching_allocator.cpp.
//
// The rules are those of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp):
// - A request is rounded to 512 bytes (or to its roundup_power2_divisions step), with no padding.
// - Requests up to 1 MiB belong to the small pool, larger ones to the large pool; each memory
//   pool (the card's general one, graph pools, user pools) has one of each.
// - A request is served from the smallest free block of its pool that fits (best fit, then the
//   lowest card address: CardAddresses) among the blocks of the stream it is made on: a block
//   freed on one stream serves that stream again (segments, and the blocks split from them,
//   belong to the stream they were reserved on). Only when none fits is a segment reserved:
//   2 MiB for a small request, 20 MiB for a large one below 10 MiB, else the request rounded up
//   to 2 MiB.
// - A block larger than the request is split when the remainder is at least 512 bytes (small
//   pool) or more than 1 MiB (large pool, and only for requests below max_split_size);
//   otherwise the whole block is handed out and counted.
// - A freed block merges with its free neighbours in the segment. Only whole free segments go
//   back to the host (empty_cache, garbage collection, and the retry before an out-of-memory).
// - Blocks of max_split_size or more ("oversize") serve only requests of max_split_size or
//   more, and at most kLargeBuffer smaller than themselves.
// Each segment is one host allocation; its blocks are slices of it, so reserved bytes are host
// memory, as a card's reserved bytes are device memory. With expandable_segments, new memory is
// instead pages mapped into one large address range per pool and stream (expandable_segments.h).
//
// A segment's host memory comes from the heap, or (Backing::kReservedAddressSpace, the planner's
// shapes mode) for larger segments from reserved address space that costs no host RAM until the
// host writes it; the pages inside a free block go back to the host. Under that backing every
// block place() hands out reads as zeros (dropped or fresh pages; what remains is cleared), so
// what a program reads from memory no kernel wrote does not depend on what was there before.
//
// Not thread-safe: the caller serialises every call (the card's CardAllocator holds its lock).
#pragma once

#include "host_memory.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace supa {

constexpr size_t kMemoryAlignment = 64;    // of pinned host memory
constexpr size_t kSegmentAlignment = 512;  // of the segments' host memory (blocks are 512-byte multiples)
constexpr size_t kMinBlockSize = 512;      // requests are rounded to 512-byte blocks
constexpr size_t kSmallSize = 1 << 20;     // requests up to 1 MiB belong to the small pool
constexpr size_t kSmallBuffer = 2 << 20;   // the small pool's segments
constexpr size_t kLargeBuffer = 20 << 20;  // the large pool's segments for requests below kMinLargeAlloc
constexpr size_t kMinLargeAlloc = 10 << 20;
constexpr size_t kRoundLarge = 2 << 20;    // larger segments are rounded to this
constexpr size_t kRoundUpStart = 1 << 20;  // roundup_power2_divisions intervals start at 1 MiB
// roundup_power2_divisions has one entry per power-of-two interval from 1 MiB (the last is open).
constexpr size_t kRoundUpIntervals = 16;
// More than any card holds: rounding a larger request up would wrap around (a negative size cast
// to size_t is far above it).
constexpr size_t kLargestRequest = size_t{1} << 60;

// A memory pool's identity: (graph pool n, user pool n); (0, 0) is the card's general pool.
// The same type as c10::MempoolId_t (see mem_pool.cpp).
using PoolId = std::pair<unsigned long long, unsigned long long>;

// The allocator settings that change which blocks are made and reused.
struct BlockPolicy {
  int64_t max_split_size = -1;  // -1: unlimited
  double gc_threshold = 0.0;    // 0: off
  std::vector<size_t> divisions = std::vector<size_t>(kRoundUpIntervals, 0);  // per power of two from 1 MiB
  bool expandable = false;  // expandable_segments: new memory is mapped into expandable segments

  // The block size that serves a request of `nbytes` (rounded to 512 bytes or to the interval's
  // roundup_power2_divisions step).
  size_t round_size(size_t nbytes) const;
  bool is_oversize(size_t size) const;
  // Whether a free block of `block_size` may serve a request of rounded `size` (max_split_size).
  bool may_serve(size_t block_size, size_t size) const;
};

// The size of the segment reserved for a request of rounded `size`.
size_t segment_size(size_t size);

struct CardBlock;

// Where a block of `size` at `card_address` sorts among free blocks (a request's search key).
struct BlockOrder {
  size_t size;
  uint64_t card_address;
};

// The free blocks of one (pool, small or large, stream): the smallest first, then the lowest address.
struct BlockBySize {
  using is_transparent = void;  // looked up by BlockOrder too
  bool operator()(const CardBlock* a, const CardBlock* b) const;
  bool operator()(const CardBlock* a, const BlockOrder& b) const;
  bool operator()(const BlockOrder& a, const CardBlock* b) const;
};
using FreeBlocks = std::set<CardBlock*, BlockBySize>;

// A segment: one host allocation, the unit reserved and released.
struct CardSegment {
  void* ptr;
  size_t size;
  int device;
  PoolId pool;
  bool small;     // of the small pool
  bool oversize;  // decided when it was reserved (max_split_size at that time)
  int64_t stream;  // the stream it was reserved on (its blocks serve only that stream)
  struct CardBlock* first = nullptr;  // its blocks, linked in address order
  FreeBlocks* free_list = nullptr;    // where its free blocks are (its pool, pool size and stream's)
  uint64_t card_address = 0;  // where it lies in the card's address space (CardAddresses)
  size_t page = 0;  // an expandable segment's page (size: its address range); 0: not expandable

  bool expandable() const { return page != 0; }
};

// The card's address space, in which segments are laid out first fit from its start, as a
// device's allocator hands out ranges. "Lowest address" among free blocks of equal size is the
// card address: the host addresses behind segments (heap or mapped pages, by mode and by the
// host allocator's state) have no fixed order, and taking the lowest of those made the same
// program pick other blocks, and reserve other bytes, in a compute- and a shapes-mode run.
class CardAddresses {
 public:
  uint64_t take(size_t size) {
    uint64_t at = 0;
    for (const auto& [start, length] : used_) {
      if (start >= at + size) {
        break;
      }
      at = start + length;
    }
    used_.emplace(at, size);
    return at;
  }
  void give_back(uint64_t at) { used_.erase(at); }

 private:
  std::map<uint64_t, size_t> used_;  // start -> length
};

// A block: a slice of a segment, allocated or free.
struct CardBlock {
  void* ptr;
  size_t size;       // what the statistics count
  size_t requested;  // what the caller asked for (while free: what its last caller asked for)
  int device;
  bool allocated;
  PoolId pool{0, 0};
  bool small = false;
  uint64_t freed_at = 0;  // order of the last free on its card, for garbage collection
  bool oversize = false;  // decided when it was handed out (max_split_size at that time)
  int64_t stream = 0;     // its segment's
  std::vector<int64_t> used_on{};  // other streams that used it (record_stream), while allocated
  CardSegment* segment = nullptr;
  bool mapped = true;  // false: address space of an expandable segment with no pages mapped
  CardBlock* prev = nullptr;  // neighbours in the segment
  CardBlock* next = nullptr;

  bool is_split() const { return prev != nullptr || next != nullptr; }
  // Where it lies on the card (a lookup key, without a segment, lies at 0).
  uint64_t card_address() const {
    return segment == nullptr ? 0
                              : segment->card_address + static_cast<uint64_t>(static_cast<const char*>(ptr) -
                                                                              static_cast<const char*>(segment->ptr));
  }
};

inline bool BlockBySize::operator()(const CardBlock* a, const CardBlock* b) const {
  return a->size != b->size ? a->size < b->size : a->card_address() < b->card_address();
}
inline bool BlockBySize::operator()(const CardBlock* a, const BlockOrder& b) const {
  return a->size != b.size ? a->size < b.size : a->card_address() < b.card_address;
}
inline bool BlockBySize::operator()(const BlockOrder& a, const CardBlock* b) const {
  return a.size != b->size ? a.size < b->size : a.card_address < b->card_address();
}

// How a request was served (CardMemory::place).
struct Placement {
  CardBlock* block = nullptr;          // null: the request did not fit
  const CardSegment* segment = nullptr;  // the segment reserved for it, if one was
  int retries = 0;                     // times the whole cache was released to make room
  int host_error = 0;                  // the host could not back a segment the card had room for (errno)
  int inactive_split = 0;              // change of the free blocks in split segments
  int64_t inactive_split_bytes = 0;    // and of their bytes
};

// What a free changed (CardMemory::cache).
struct Release {
  int inactive_split = 0;
  int64_t inactive_split_bytes = 0;
};

class CardMemory {
 public:
  // Called for each segment going back to the host, before its memory is freed.
  using SegmentReleased = std::function<void(const CardSegment&)>;
  // Called when pages of an expandable segment are mapped (`mapped`) or unmapped, with their range.
  using PagesChanged = std::function<void(const CardSegment&, void* ptr, size_t size, bool mapped)>;

  // What the card asks of a pool's owner (mem_pool.h): whether the pool is in use (a live MemPool, a
  // graph's private pool: its cache is kept), whether a request short of memory may take its cache
  // back (use_on_oom), and whether its blocks are never split (no_split).
  struct PoolRules {
    std::function<bool(const PoolId&)> in_use;
    std::function<bool(const PoolId&)> use_on_oom;
    std::function<bool(const PoolId&)> no_split;
  };

  // The card's segments outlive it (the process's cards live until exit).
  CardMemory(int device, int64_t capacity, SegmentReleased on_release, Backing backing = Backing::kHeap,
             PoolRules pool_rules = {});
  ~CardMemory() {
    for (CardBlock* block : spare_blocks_) {
      delete block;
    }
  }
  CardMemory(const CardMemory&) = delete;
  CardMemory& operator=(const CardMemory&) = delete;

  void set_pages_changed(PagesChanged pages_changed) { pages_changed_ = std::move(pages_changed); }
  int64_t capacity() const { return capacity_; }
  Backing backing() const { return backing_; }
  int64_t reserved() const { return reserved_; }
  double fraction() const { return fraction_; }
  void set_fraction(double fraction) { fraction_ = fraction; }
  // What this process may reserve: the capacity times set_per_process_memory_fraction.
  int64_t limit() const;
  // Capacity not reserved (what cudaMemGetInfo reports as free).
  int64_t unreserved() const;
  size_t cached_blocks() const;
  const std::map<uintptr_t, CardSegment*>& segments() const { return segments_; }
  // The segment that holds `ptr`, or null.
  const CardSegment* segment_of(const void* ptr) const;
  // The segment's blocks in address order (an expandable segment's unmapped ranges too).
  std::vector<const CardBlock*> blocks_of(const CardSegment& segment) const;

  // Serves a request of rounded `size` for `pool` made on `stream`: the best-fitting free block of
  // the pool and stream, else a new segment, after garbage collection and, when the card is full, releasing the cache.
  // The block is split to the request where the rules allow; it is returned unmarked (the caller
  // sets allocated and requested).
  Placement place(size_t size, const PoolId& pool, const BlockPolicy& policy, int64_t stream = 0);
  // Takes a freed block back, merged with its free neighbours (`block` may be deleted).
  Release cache(CardBlock* block);
  // What place() would hand out now for a request of rounded `size` without reserving or
  // releasing anything (block null when no free block fits), taken without changing changes():
  // an operator kernel's first allocation, which is the card's only if the operator hands it back
  // while the card is otherwise as it was (caching_allocator.cpp). give_back() undoes it exactly
  // under the same condition.
  Placement take_free(size_t size, const PoolId& pool, const BlockPolicy& policy, int64_t stream);
  Release give_back(CardBlock* block);  // the free blocks' change, as cache() reports it (`block` may be deleted)
  // Gives back a taken block, then places a request of rounded `size` as place() would when a
  // free block fits (a change), without reserving or releasing anything: no block when none fits.
  // Under heap backing nothing writes the given-back memory, so its bytes stay readable until the
  // caller moves them (the new block may overlap them).
  Placement place_after_give_back(CardBlock* taken, size_t size, const PoolId& pool, const BlockPolicy& policy,
                                  int64_t stream, Release& given_back);
  // Takes the free memory [ptr, ptr + size) as one block, as take_free does (a block given back
  // taken again where it was): no block when part of it is not free.
  Placement take_at(void* ptr, size_t size, const BlockPolicy& policy);
  // Counts the calls that change the card (place, cache, release_cached).
  uint64_t changes() const { return changes_; }
  // Returns the whole free segments to the host: `pool`'s when given, else those of every pool not
  // in use (a graph may still replay into its pool's free blocks, as a card's graph does), and, for
  // a request short of memory (`for_oom`), those of the pools that allow it.
  void release_cached(const PoolId* pool = nullptr, bool for_oom = false);

 private:
  // The free blocks of one (pool, small or large, stream).
  using FreeKey = std::tuple<PoolId, bool, int64_t>;
  // Requests come mostly from one pool and stream: the last list found is looked up first.
  FreeBlocks& free_blocks(const PoolId& pool, bool small, int64_t stream) {
    FreeKey key{pool, small, stream};
    FreeKey& last = last_free_key_[small ? 1 : 0];
    FreeBlocks*& found = last_free_[small ? 1 : 0];
    if (found == nullptr || key != last) {
      found = &free_[key];  // std::map: the list stays where it is
      last = key;
    }
    return *found;
  }
  FreeBlocks& free_blocks_of(const CardBlock& block) { return *block.segment->free_list; }
  // A free list's insertions and removals, and blocks made and deleted by splits and merges, reuse
  // the nodes and blocks of earlier ones: an operator's result split off and merged back on every
  // call costs the heap nothing (the lists and blocks are as with fresh ones).
  static constexpr size_t kSpares = 64;  // nodes and blocks kept (a few per live split)
  void insert_free(FreeBlocks& blocks, CardBlock* block) {
    if (spare_nodes_.empty()) {
      blocks.insert(block);
      return;
    }
    FreeBlocks::node_type node = std::move(spare_nodes_.back());
    spare_nodes_.pop_back();
    node.value() = block;
    blocks.insert(std::move(node));
  }
  void erase_free(FreeBlocks& blocks, FreeBlocks::iterator it) {
    spare_nodes_.size() < kSpares ? spare_nodes_.push_back(blocks.extract(it)) : void(blocks.erase(it));
  }
  void erase_free(FreeBlocks& blocks, CardBlock* block) {
    if (auto it = blocks.find(block); it != blocks.end()) {
      erase_free(blocks, it);
    }
  }
  // A free block at `ptr` in `like`'s segment.
  CardBlock* new_block(void* ptr, size_t size, const CardBlock& like) {
    CardBlock* block = spare_blocks_.empty() ? new CardBlock{} : spare_blocks_.back();
    if (!spare_blocks_.empty()) {
      spare_blocks_.pop_back();
    }
    *block = CardBlock{ptr, size, 0, device_, false, like.pool, like.small, like.freed_at, false, like.stream};
    block->segment = like.segment;
    return block;
  }
  void delete_block(CardBlock* block) {
    spare_blocks_.size() < kSpares ? spare_blocks_.push_back(block) : void(delete block);
  }
  // Splits and merges (block_splits.h).
  bool hand_out_free(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy, Placement& placed);
  bool splits(const CardBlock& block, size_t size, const BlockPolicy& policy) const;
  static void count_split(bool already_split, size_t size, size_t remaining, Placement& placed);
  void split_front(FreeBlocks& blocks, FreeBlocks::iterator it, size_t size, const BlockPolicy& policy,
                   Placement& placed);
  Release merge_freed(CardBlock* block);
  CardBlock* reserve(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy, Placement& placed);
  CardBlock* new_segment(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy, Placement& placed);
  // A free block of `bytes` before (or after) `block`, carved from it: linked into its segment, in no list.
  CardBlock* carve(CardBlock* block, void* at, size_t bytes, bool before);

  // Expandable segments (expandable_segments.cpp).
  struct ByAddress {
    bool operator()(const CardBlock* a, const CardBlock* b) const { return a->ptr < b->ptr; }
  };
  using UnmappedBlocks = std::set<CardBlock*, ByAddress>;
  UnmappedBlocks& unmapped_blocks_of(const CardBlock& block) {
    return unmapped_[FreeKey{block.pool, block.small, block.stream}];
  }
  FreeBlocks::iterator expandable_choice(FreeBlocks& blocks, FreeBlocks::iterator it, const BlockPolicy& policy) const;
  CardBlock* grow_expandable(size_t size, const PoolId& pool, int64_t stream, Placement& placed);
  CardBlock* expandable_room(size_t size, const PoolId& pool, int64_t stream, Placement& placed);
  bool map_pages(CardBlock* block, size_t bytes, Placement& placed);
  void unmap_free_pages(CardBlock* block);
  bool release_oversize(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy);
  void collect_garbage(size_t incoming, const BlockPolicy& policy);
  void hand_out(CardBlock* block, size_t size, const BlockPolicy& policy, Placement& placed);
  Release merge_free(CardBlock* block);
  // Under kReservedAddressSpace: the pages inside a free block go back to the host, and a block
  // handed out reads as zeros.
  void drop_pages(const CardBlock& block) const;
  void clear(const CardBlock& block) const;
  void release(CardBlock* block);

  int device_;
  int64_t capacity_;
  double fraction_ = 1.0;
  int64_t reserved_ = 0;
  uint64_t frees_ = 0;
  uint64_t changes_ = 0;
  std::map<FreeKey, FreeBlocks> free_;
  FreeKey last_free_key_[2];             // large, small
  FreeBlocks* last_free_[2] = {nullptr, nullptr};
  std::map<uintptr_t, CardSegment*> segments_;          // by address
  std::vector<FreeBlocks::node_type> spare_nodes_;
  std::vector<CardBlock*> spare_blocks_;
  CardAddresses addresses_;
  std::map<FreeKey, UnmappedBlocks> unmapped_;           // expandable segments' unmapped ranges
  SegmentReleased on_release_;
  PagesChanged pages_changed_;
  PoolRules pool_rules_;
  Backing backing_;
};

}  // namespace supa
