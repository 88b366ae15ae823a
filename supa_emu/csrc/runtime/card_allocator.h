// One card's caching allocator, as CUDA's DeviceCachingAllocator is one device's: the card's memory
// (card_memory.h), the statistics PyTorch keeps for it, its allocator settings, its freed blocks
// on their way back to the cache (freed_blocks.cpp) and its operator kernels' provisional blocks
// (provisional_blocks.cpp), all under the card's own lock: every public member takes it, the
// private ones run under it. The process's cards, the c10 allocator over them and the table of
// whose pointer a block is (block_table.h) are caching_allocator.cpp's.
#pragma once

#include "block_table.h"
#include "caching_allocator.h"
#include "card_memory.h"
#include "light_mutex.h"
#include "provisional_blocks.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Stream.h>

#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace torch {
struct CapturedTraceback;
}

namespace supa {

using Stack = std::shared_ptr<torch::CapturedTraceback>;

class CardAllocator {
 public:
  CardAllocator(c10::DeviceIndex device, int64_t capacity, Backing backing, BlockTable& table);
  ~CardAllocator() {
    for (ProvisionalBlock* record : spare_records_) {
      delete record;
    }
  }
  CardAllocator(const CardAllocator&) = delete;
  CardAllocator& operator=(const CardAllocator&) = delete;

  // A block for a request of `nbytes` of `pool` on `stream`, counted as allocated and in the table;
  // raises out of memory.
  CardBlock* allocate(size_t nbytes, const PoolId& pool, c10::StreamId stream, const Stack& stack);
  // A block the table gave up: uncounted, and reusable once the streams that used it pass the free.
  void free(CardBlock* block, const Stack& stack);
  void record_stream(CardBlock* block, c10::StreamId stream);

  // Operator kernels' allocations (provisional_blocks.cpp). A provisional block of `nbytes`, in
  // the table: a free block of the card as place() would hand it out now (`from_card`, when one
  // fits), else host memory.
  void* take_provisional(size_t nbytes, bool from_card, const PoolId& pool, c10::StreamId stream, uint64_t call);
  // One the table gave up, freed before it was committed: back where it came from.
  void drop_provisional(ProvisionalBlock* block, void* ptr);
  // The card's provisional block in the table at `ptr` (`held` null; none: null), or the displaced
  // `held` (in no table), placed as a request made now by operator call `call`: the card's block (in
  // the table in its place), at `ptr` when it is the block placing hands out, else with the bytes
  // moved there. Blocks of the call set aside meanwhile whose addresses the card handed on go to
  // `displaced`, for the calling thread to hold (as the block itself, if placing raises).
  CardBlock* commit(ProvisionalBlock* held, void* ptr, uint64_t call, const Stack& stack,
                    std::vector<DisplacedBlock>& displaced);

  // A graph begins (ends) capturing on the card (freed_blocks.cpp).
  void capture_begin(c10::StreamId stream);
  void capture_ended();

  // Returns whole free segments to the host: `pool`'s, or (null) those of the pools not in use,
  // after waiting for the streams that use freed blocks (`wait_for_streams`).
  void empty_cache(const PoolId* pool, bool wait_for_streams);
  void set_policy(const BlockPolicy& policy, bool capture_record_stream_reuse);
  c10::CachingDeviceAllocator::DeviceStats stats();
  void reset_accumulated_stats();
  void reset_peak_stats();
  c10::DeviceIndex device() const { return device_; }
  int64_t capacity() const { return card_.capacity(); }  // fixed at creation
  std::pair<size_t, size_t> memory_info();  // (unreserved, capacity)
  void set_fraction(double fraction);
  double fraction();
  bool holds(const void* ptr);  // inside one of the card's segments
  std::vector<SegmentInfo> snapshot();

 private:
  using DeviceStats = c10::CachingDeviceAllocator::DeviceStats;

  void segment_released(const CardSegment& segment);
  void pages_changed(const CardSegment& segment, void* ptr, size_t size, bool mapped);
  [[noreturn]] void raise_oom(size_t size, const Stack& stack);
  [[noreturn]] void raise_host_oom(size_t size, int error);
  void count_inactive_split(bool small, int blocks, int64_t bytes);
  // Counts a block the card handed out for a request of `nbytes` as allocated and puts it in the
  // table (`split_counted`: the free blocks' change was counted when it was taken; `in_table`: it is
  // there already, committed in place of its provisional block).
  CardBlock* count_placed(const Placement& placed, size_t nbytes, const Stack& stack, bool split_counted = false,
                          bool in_table = false);
  CardBlock* place_block(size_t nbytes, const PoolId& pool, c10::StreamId stream, const Stack& stack);

  // freed_blocks.cpp
  void return_to_cache(CardBlock* block);
  void settle_pending_frees(bool wait);
  void release_after_uses(CardBlock* block);
  std::vector<std::pair<c10::StreamId, uint64_t>> capture_free_points(const CardBlock& block);
  void settle_capture_frees(c10::StreamId stream);

  // provisional_blocks.cpp
  bool placed_as_taken(const ProvisionalBlock& block) const;
  void gave_back(const ProvisionalBlock& block);
  void give_back_taken(ProvisionalBlock& block);
  struct SetAside {
    ProvisionalBlock* block;
    void* ptr;
    size_t size;  // of the block it held
  };
  std::vector<SetAside> set_aside_taken(const ProvisionalBlock* keep, uint64_t call);
  void take_again(const std::vector<SetAside>& set_aside, std::vector<DisplacedBlock>& displaced);
  void forget_taken(const ProvisionalBlock* block);
  // Provisional blocks' records, made and deleted by every operator call that allocates, are reused.
  ProvisionalBlock* new_record(ProvisionalBlock&& like);
  void delete_record(ProvisionalBlock* record);
  struct RecordDeleter {
    CardAllocator* card;
    void operator()(ProvisionalBlock* record) const { card->delete_record(record); }
  };
  std::vector<ProvisionalBlock*> spare_records_;

  LightMutex mutex_;
  const c10::DeviceIndex device_;
  const c10::Device device_as_c10_;  // made once: the profiler's reports name it at every block
  BlockTable& table_;
  CardMemory card_;
  DeviceStats stats_;
  BlockPolicy policy_;  // `_set_allocator_settings`, as every card has them
  const Stack* placing_ = nullptr;  // the stack of the request being placed (for pages it maps)

  // Freed blocks that streams they were recorded on have not reached yet, with the time they will
  // (stream_timeline.h): still active, not yet reusable.
  std::vector<std::pair<CardBlock*, int64_t>> pending_free_;
  // Graph captures under way on the card, and the blocks freed during them that other streams
  // used: each with the points placed on those streams at its free (capture_order.h;
  // graph_capture_record_stream_reuse), or none: held until no graph captures.
  int captures_underway_ = 0;
  bool capture_record_stream_reuse_ = false;
  struct CaptureFree {
    CardBlock* block;
    std::vector<std::pair<c10::StreamId, uint64_t>> points;
  };
  std::vector<CaptureFree> capture_frees_;

  // The provisional blocks that hold a block taken from the card, and the blocks taken since the
  // card's last change, in the order they were taken.
  std::vector<ProvisionalBlock*> taken_;
  struct TakenSinceChange {
    uint64_t changes = ~uint64_t{0};  // the card's changes() they were all taken at
    uint64_t taken = 0;                // how many
    uint64_t committed = 0;            // the first `committed` were committed in place, in order
    uint64_t valid = ~uint64_t{0};     // from this index on, taken beside a block given back since
  };
  TakenSinceChange takes_;
};

}  // namespace supa
