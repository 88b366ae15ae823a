// An operator kernel's allocations (allocate_provisional), which the card counts only once the
// operator hands them back as results (commit_block): until then a provisional block is a free
// block of the card taken as the card would hand it out now (CardMemory::take_free), counted as
// allocated nowhere, or host memory of its rounded size (when none fits, or for callers that do
// not take). A block freed before it is committed (the kernel's own scratch) goes back where it
// came from, and the card's figures are as they were. The results reach the card's figures in the
// order they are committed, each placed as a request made at that moment:
//
// - A taken block is committed where it is when placing would hand out that very block: the card
//   has not changed since it was taken (no place, cache or release), every block taken before it
//   since then was committed in place, in order, and none of those was given back.
// - Otherwise its request is placed, and before that the other blocks its operator call still
//   holds taken go aside (their bytes to the host, their blocks back to the card, their addresses
//   out of the table), so that the card holds nothing of that call uncounted while it places; the
//   bytes then move in. Those set aside take their addresses again once it is placed, where the
//   card still has them free, so no other thread is handed them before they are committed or
//   dropped. Where it does not (the result landed on one, or placing gave its memory back to the
//   host: an out-of-memory retry, a released expandable page), the address is the card's to hand
//   on, and the block, displaced, keeps its bytes aside in no table: the thread of its call holds
//   it (DisplacedBlock), found by the pointer its storage holds, which may meanwhile be another
//   thread's block (once, its table entry stayed there, and a kernel of another thread taking
//   that address failed).
//
// The free blocks of split segments ("inactive_split") are counted as the card holds them, taken
// blocks included: a take and a give-back change them at once. The state is the card's
// (card_allocator.h); these are its members, run under its lock, and the entry points above them.
#include "provisional_blocks.h"

#include "card_allocator.h"
#include "light_mutex.h"
#include "device_guard.h"
#include "mem_pool.h"
#include "memory_history.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>

namespace supa {
namespace {

std::atomic<uint64_t> g_operator_calls{0};
thread_local uint64_t t_operator_call = 0;
// This thread's displaced blocks (provisional_blocks.h), a few at most for the rest of its call;
// null while it has none: a plain pointer, so that the check on every free and commit costs no
// thread-local initialisation.
thread_local std::vector<DisplacedBlock>* t_displaced = nullptr;

// The displaced block of this thread at `ptr`, out of its list; null when none is.
ProvisionalBlock* take_displaced(const void* ptr) {
  if (t_displaced == nullptr) {
    return nullptr;
  }
  for (auto it = t_displaced->begin(); it != t_displaced->end(); ++it) {
    if (it->ptr == ptr) {
      ProvisionalBlock* block = it->block;
      t_displaced->erase(it);
      if (t_displaced->empty()) {
        delete std::exchange(t_displaced, nullptr);
      }
      return block;
    }
  }
  return nullptr;
}

void keep_displaced(const std::vector<DisplacedBlock>& displaced) {
  if (!displaced.empty()) {
    if (t_displaced == nullptr) {
      t_displaced = new std::vector<DisplacedBlock>();
    }
    t_displaced->insert(t_displaced->end(), displaced.begin(), displaced.end());
  }
}

// Host memory of small provisional blocks (a kernel's scratch: a wrapped scalar's copy, a reduction's
// buffer), kept for the next call: a 512-byte-aligned allocation takes the heap's slow path (no
// thread cache) every time, which cost an in-place add_ a tenth of its time. Below
// kReservedBackingMin every backing is the heap, so a kept block serves any card.
class HostScratch {
 public:
  void* take(size_t size, Backing backing) {
    if (std::vector<void*>* kept = of_size(size)) {
      std::lock_guard<LightMutex> lock(mutex_);
      if (!kept->empty()) {
        void* ptr = kept->back();
        kept->pop_back();
        return ptr;
      }
    }
    return back(size, backing);
  }
  void give(void* ptr, size_t size, Backing backing) {
    if (std::vector<void*>* kept = of_size(size)) {
      std::lock_guard<LightMutex> lock(mutex_);
      if (kept->size() < kKept) {
        kept->push_back(ptr);
        return;
      }
    }
    unback(ptr, size, backing);
  }

 private:
  static constexpr size_t kLargest = 4096;
  static constexpr size_t kKept = 16;  // per size: at most 288 KiB held in all
  static_assert(kLargest < kReservedBackingMin, "kept blocks must be heap memory under every backing");
  std::vector<void*>* of_size(size_t size) {
    return size <= kLargest && size % kMinBlockSize == 0 ? &kept_[size / kMinBlockSize - 1] : nullptr;
  }
  LightMutex mutex_;
  std::array<std::vector<void*>, kLargest / kMinBlockSize> kept_;
};
HostScratch g_host_scratch;

}  // namespace

void begin_operator_allocations() {
  t_operator_call = ++g_operator_calls;
}

void* allocate_provisional(size_t nbytes, c10::DeviceIndex device, bool from_card) {
  check_request_size(nbytes);
  const PoolId pool = from_card ? allocation_pool(device) : PoolId{0, 0};
  const c10::StreamId stream = from_card ? current_stream_id(device) : 0;
  return card_allocator(device).take_provisional(nbytes, from_card, pool, stream, t_operator_call);
}

bool drop_provisional(void* ptr) {
  ProvisionalBlock* block = take_displaced(ptr);
  if (block == nullptr) {
    block = block_table().remove_provisional(ptr);
  }
  if (block == nullptr) {
    return false;
  }
  card_allocator(block->device).drop_provisional(block, ptr);
  return true;
}

void delete_provisional(void* ptr) {
  if (ptr != nullptr) {
    const bool dropped = drop_provisional(ptr);
    TORCH_INTERNAL_ASSERT(dropped, "supa_emu: freeing unknown provisional pointer");
  }
}

void* commit_block(void* ptr, c10::DeviceIndex device) {
  // Only its holder commits or frees a provisional block: found here, it stays this caller's.
  ProvisionalBlock* held = take_displaced(ptr);
  if (held != nullptr && held->device != device) {
    keep_displaced({{ptr, held}});
    return nullptr;
  }
  std::vector<DisplacedBlock> displaced;
  CardBlock* committed = nullptr;
  try {
    committed = card_allocator(device).commit(held, ptr, t_operator_call, memory_event_stack(), displaced);
  } catch (...) {
    keep_displaced(displaced);
    throw;
  }
  if (!displaced.empty()) {  // rarely: no call otherwise
    keep_displaced(displaced);
  }
  if (committed == nullptr) {  // not a provisional block of `device`
    return nullptr;
  }
  report_block_to_gpu_trace(committed->ptr, true);
  return committed->ptr;
}

void* CardAllocator::take_provisional(size_t nbytes, bool from_card, const PoolId& pool, c10::StreamId stream,
                                      uint64_t call) {
  std::unique_lock<LightMutex> lock(mutex_);
  const size_t size = policy_.round_size(nbytes);
  if (from_card) {
    const Placement taken = card_.take_free(size, pool, policy_, stream);
    if (CardBlock* block = taken.block) {
      block->allocated = true;
      count_inactive_split(block->small, taken.inactive_split, taken.inactive_split_bytes);
      const uint64_t changes = card_.changes();
      if (takes_.changes != changes) {
        takes_ = TakenSinceChange{changes};
      }
      ProvisionalBlock* record = new_record({size, nbytes, device_, call, block, changes, takes_.taken++});
      taken_.push_back(record);
      table_.add_provisional(block->ptr, record);
      return block->ptr;
    }
  }
  const Backing backing = card_.backing();
  lock.unlock();
  void* ptr = g_host_scratch.take(size, backing);
  if (ptr == nullptr) {
    const int error = errno;
    lock.lock();
    raise_host_oom(size, error);
  }
  table_.add_provisional(ptr, new ProvisionalBlock{size, nbytes, device_, call});
  return ptr;
}

void CardAllocator::drop_provisional(ProvisionalBlock* block, void* ptr) {
  if (block->taken != nullptr) {
    std::lock_guard<LightMutex> lock(mutex_);
    forget_taken(block);
    give_back_taken(*block);
    delete_record(block);
    return;
  }
  std::unique_ptr<ProvisionalBlock> dropped(block);
  if (block->aside.empty()) {
    g_host_scratch.give(ptr, block->size, card_.backing());
  }
}

ProvisionalBlock* CardAllocator::new_record(ProvisionalBlock&& like) {
  if (spare_records_.empty()) {
    return new ProvisionalBlock(std::move(like));
  }
  ProvisionalBlock* record = spare_records_.back();
  spare_records_.pop_back();
  *record = std::move(like);
  return record;
}

void CardAllocator::delete_record(ProvisionalBlock* record) {
  constexpr size_t kSpareRecords = 16;  // an operator call's results, and then some
  if (spare_records_.size() < kSpareRecords) {
    record->aside = std::vector<char>();
    spare_records_.push_back(record);
  } else {
    delete record;
  }
}

// Whether placing the request of `block` now would hand out the very block it took.
bool CardAllocator::placed_as_taken(const ProvisionalBlock& block) const {
  return block.changes == card_.changes() && takes_.changes == block.changes && block.index == takes_.committed &&
         block.index < takes_.valid;
}

// A taken block goes back to the card: the blocks taken after it were taken beside it.
void CardAllocator::gave_back(const ProvisionalBlock& block) {
  if (takes_.changes == block.changes) {
    takes_.valid = std::min(takes_.valid, block.index);
  }
}

void CardAllocator::give_back_taken(ProvisionalBlock& block) {
  gave_back(block);
  const bool small = block.taken->small;
  const Release released = card_.give_back(block.taken);
  count_inactive_split(small, released.inactive_split, released.inactive_split_bytes);
  block.taken = nullptr;
}

void CardAllocator::forget_taken(const ProvisionalBlock* block) {
  taken_.erase(std::find(taken_.begin(), taken_.end(), block));
}

// Before a placement for operator call `call`: the blocks it still holds taken on the card, other
// than `keep`, go aside.
std::vector<CardAllocator::SetAside> CardAllocator::set_aside_taken(const ProvisionalBlock* keep, uint64_t call) {
  std::vector<SetAside> set_aside;
  for (ProvisionalBlock* block : taken_) {
    if (block == keep || block->call != call) {
      continue;
    }
    void* ptr = block->taken->ptr;
    table_.remove_provisional(ptr);
    set_aside.push_back({block, ptr, block->taken->size});
    block->aside.assign(static_cast<const char*>(ptr), static_cast<const char*>(ptr) + block->requested);
    give_back_taken(*block);
  }
  for (const SetAside& entry : set_aside) {
    forget_taken(entry.block);
  }
  return set_aside;
}

// After the placement: each block set aside takes its address again where the card has it free
// (its bytes back in it: under reserved backing the given-back pages were dropped), back in the
// table; it is no longer what placing would hand out: committing it places it anew. Elsewhere it
// is displaced, its bytes aside.
void CardAllocator::take_again(const std::vector<SetAside>& set_aside, std::vector<DisplacedBlock>& displaced) {
  for (const SetAside& entry : set_aside) {
    const Placement taken = card_.take_at(entry.ptr, entry.size, policy_);
    if (taken.block == nullptr) {
      displaced.push_back({entry.ptr, entry.block});
      continue;
    }
    ProvisionalBlock& block = *entry.block;
    taken.block->allocated = true;
    count_inactive_split(taken.block->small, taken.inactive_split, taken.inactive_split_bytes);
    std::memcpy(entry.ptr, block.aside.data(), block.requested);
    block.aside = std::vector<char>();
    block.taken = taken.block;
    block.changes = ~uint64_t{0};
    taken_.push_back(&block);
    table_.add_provisional(entry.ptr, &block);
  }
}

CardBlock* CardAllocator::commit(ProvisionalBlock* held, void* ptr, uint64_t call, const Stack& stack,
                                 std::vector<DisplacedBlock>& displaced) {
  std::lock_guard<LightMutex> lock(mutex_);
  ProvisionalBlock* block = held;
  bool in_place = false;
  if (block == nullptr) {  // out of the table, and the card's block in its place when committed there
    block = table_.claim_provisional(ptr, [&](ProvisionalBlock& found, CardBlock*& counted) {
      if (found.device != device_) {
        return false;
      }
      in_place = found.taken != nullptr && placed_as_taken(found);
      if (in_place) {
        counted = found.taken;
        counted->requested = found.requested;  // as readers of the table find it from now on
      }
      return true;
    });
    if (block == nullptr) {
      return nullptr;
    }
  }
  std::unique_ptr<ProvisionalBlock, RecordDeleter> provisional(block, RecordDeleter{this});  // under the lock
  if (block->taken != nullptr) {
    forget_taken(block);
    if (in_place) {
      takes_.committed++;
      Placement placed;
      placed.block = block->taken;
      return count_placed(placed, block->requested, stack, /*split_counted=*/true, /*in_table=*/true);
    }
  }
  const PoolId pool = allocation_pool(device_);
  const c10::StreamId stream = current_stream_id(device_);
  std::vector<SetAside> set_aside = set_aside_taken(block, call);
  const size_t taken_size = block->taken != nullptr ? block->taken->size : 0;
  Placement placed;
  if (block->taken != nullptr && card_.backing() == Backing::kHeap) {
    // Among the card's free blocks where one fits: nothing writes the given-back memory under
    // heap backing, so the bytes move within the card's memory, if at all.
    gave_back(*block);
    const bool small = block->taken->small;
    Release released;
    placed = card_.place_after_give_back(block->taken, block->size, pool, policy_, stream, released);
    count_inactive_split(small, released.inactive_split, released.inactive_split_bytes);
    if (placed.block == nullptr) {  // placing may release memory: the bytes go aside first
      block->aside.assign(static_cast<const char*>(ptr), static_cast<const char*>(ptr) + block->requested);
    }
    block->taken = nullptr;
  }
  CardBlock* committed = nullptr;
  if (placed.block != nullptr) {
    committed = count_placed(placed, block->requested, stack);
    if (committed->ptr != ptr) {
      std::memmove(committed->ptr, ptr, block->requested);
    }
  } else {
    const bool host_memory = block->taken == nullptr && block->aside.empty();
    if (block->taken != nullptr) {  // shapes mode: giving back returns the pages
      block->aside.assign(static_cast<const char*>(ptr), static_cast<const char*>(ptr) + block->requested);
      give_back_taken(*block);
    }
    try {
      committed = place_block(block->requested, pool, stream, stack);
    } catch (...) {
      // Out of memory: the block stays provisional, for its holder to free.
      provisional.release();
      if (taken_size != 0) {
        set_aside.push_back({block, ptr, taken_size});
      } else if (host_memory) {
        table_.add_provisional(ptr, block);
      } else {
        displaced.push_back({ptr, block});
      }
      take_again(set_aside, displaced);
      throw;
    }
    std::memcpy(committed->ptr, host_memory ? ptr : block->aside.data(), block->requested);
    if (host_memory) {
      g_host_scratch.give(ptr, block->size, card_.backing());
    }
  }
  take_again(set_aside, displaced);
  return committed;
}

}  // namespace supa
