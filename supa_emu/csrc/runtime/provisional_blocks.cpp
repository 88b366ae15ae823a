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
//   holds taken go aside (their bytes to the host, their blocks back to the card), so that the
//   card holds nothing of that call uncounted while it places; the bytes then move in.
//
// The free blocks of split segments ("inactive_split") are counted as the card holds them, taken
// blocks included: a take and a give-back change them at once.
#include "provisional_blocks.h"

#include "allocator_state.h"
#include "caching_allocator.h"
#include "device_guard.h"
#include "devices.h"
#include "mem_pool.h"
#include "memory_history.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

namespace supa {

namespace allocator_state {
namespace {

// An operator kernel's allocation not yet handed back as a result.
struct ProvisionalBlock {
  size_t size;
  size_t requested;
  c10::DeviceIndex device;
  // A block of the card taken as place() would hand it out now, while the card had made `changes`
  // changes, as the `index`th take since then; none: host memory of `size` bytes at the block's
  // address, or (`aside` not empty) a taken block's bytes set aside, its block given back.
  Placement taken;
  uint64_t changes = 0;
  uint64_t index = 0;
  uint64_t call = 0;  // the operator call that took it (begin_operator_allocations)
  std::vector<char> aside;
};
std::unordered_map<void*, ProvisionalBlock> g_provisional;  // under g_mutex

std::atomic<uint64_t> g_operator_calls{0};
thread_local uint64_t t_operator_call = 0;

// The blocks taken from a card since its last change, in the order they were taken.
struct TakenSinceChange {
  uint64_t changes = ~uint64_t{0};  // the card's changes() they were all taken at
  uint64_t taken = 0;                // how many
  uint64_t committed = 0;            // the first `committed` were committed in place, in order
  uint64_t valid = ~uint64_t{0};     // from this index on, taken beside a block given back since
};
std::unordered_map<c10::DeviceIndex, TakenSinceChange> g_takes;  // under g_mutex

// Whether placing the request of `block` (taken from `card`) now would hand out that very block.
bool placed_as_taken(const ProvisionalBlock& block, const CardMemory& card) {
  if (block.changes != card.changes()) {
    return false;
  }
  const TakenSinceChange& takes = g_takes[block.device];
  return takes.changes == block.changes && block.index == takes.committed && block.index < takes.valid;
}

// A taken block goes back to the card: the blocks taken after it were taken beside it.
void gave_back(const ProvisionalBlock& block) {
  TakenSinceChange& takes = g_takes[block.device];
  if (takes.changes == block.changes) {
    takes.valid = std::min(takes.valid, block.index);
  }
}

void count_given_back(DeviceMemory& mem, bool small, const Release& released) {
  count_inactive_split(mem.stats, small, released.inactive_split, released.inactive_split_bytes);
}

void give_back_taken(ProvisionalBlock& block, DeviceMemory& mem) {
  gave_back(block);
  const bool small = block.taken.block->small;
  count_given_back(mem, small, mem.card.give_back(block.taken.block));
  block.taken = Placement{};
}

// Before a placement: the blocks this thread's operator call still holds taken on the card, other
// than `keep`, go aside.
void set_aside_taken(const void* keep, c10::DeviceIndex device, DeviceMemory& mem) {
  for (auto& [ptr, block] : g_provisional) {
    if (ptr == keep || block.taken.block == nullptr || block.call != t_operator_call || block.device != device) {
      continue;
    }
    block.aside.assign(static_cast<const char*>(ptr), static_cast<const char*>(ptr) + block.requested);
    give_back_taken(block, mem);
  }
}

}  // namespace

bool drop_provisional(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_provisional.find(ptr);
  if (it == g_provisional.end()) {
    return false;
  }
  DeviceMemory& mem = memory_of(it->second.device);
  if (it->second.taken.block != nullptr) {
    give_back_taken(it->second, mem);
  } else if (it->second.aside.empty()) {
    unback(ptr, it->second.size, mem.card.backing());
  }
  g_provisional.erase(it);
  return true;
}

c10::DeviceIndex provisional_device(const void* ptr) {
  auto it = g_provisional.find(const_cast<void*>(ptr));
  return it == g_provisional.end() ? -1 : it->second.device;
}

}  // namespace allocator_state

namespace {
using namespace allocator_state;
}  // namespace

void begin_operator_allocations() {
  t_operator_call = ++g_operator_calls;
}

void* allocate_provisional(size_t nbytes, c10::DeviceIndex device, bool from_card) {
  const size_t size = block_size(nbytes, device);
  const c10::MempoolId_t pool = from_card ? allocation_pool(device) : c10::MempoolId_t{0, 0};
  const c10::StreamId stream = from_card ? current_stream_id(device) : 0;
  std::lock_guard<std::mutex> lock(g_mutex);
  DeviceMemory& mem = memory_of(device);
  if (from_card) {
    const Placement taken = mem.card.take_free(size, pool, g_policy, stream);
    if (CardBlock* block = taken.block) {
      block->allocated = true;
      count_inactive_split(mem.stats, block->small, taken.inactive_split, taken.inactive_split_bytes);
      const uint64_t changes = mem.card.changes();
      TakenSinceChange& takes = g_takes[device];
      if (takes.changes != changes) {
        takes = TakenSinceChange{changes};
      }
      g_provisional.emplace(block->ptr,
                            ProvisionalBlock{size, nbytes, device, taken, changes, takes.taken++, t_operator_call});
      return block->ptr;
    }
  }
  void* ptr = back(size, mem.card.backing());
  if (ptr == nullptr) {
    raise_host_oom(mem, device, size, errno);
  }
  g_provisional.emplace(ptr, ProvisionalBlock{size, nbytes, device});
  return ptr;
}

void* commit_block(void* ptr) {
  c10::DeviceIndex device = -1;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_provisional.find(ptr);
    if (it == g_provisional.end()) {
      return ptr;
    }
    device = it->second.device;
  }
  const auto stack = memory_event_stack();
  const c10::MempoolId_t pool = allocation_pool(device);
  const c10::StreamId stream = current_stream_id(device);
  void* committed = nullptr;
  Placement placed;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_provisional.find(ptr);
    ProvisionalBlock provisional = std::move(it->second);
    g_provisional.erase(it);
    DeviceMemory& mem = memory_of(device);
    if (provisional.taken.block != nullptr && placed_as_taken(provisional, mem.card)) {
      committed = count_placed(mem, device, provisional.taken, provisional.requested, stack, /*split_counted=*/true)->ptr;
      g_takes[device].committed++;
    } else {
      set_aside_taken(ptr, device, mem);
      if (provisional.taken.block != nullptr && mem.card.backing() == Backing::kHeap) {
        // Among the card's free blocks where one fits: nothing writes the given-back memory under
        // heap backing, so the bytes move within the card's memory, if at all.
        gave_back(provisional);
        const bool small = provisional.taken.block->small;
        Release released;
        placed = mem.card.place_after_give_back(provisional.taken.block, provisional.size, pool, g_policy, stream,
                                                released);
        count_given_back(mem, small, released);
        if (placed.block == nullptr) {  // placing may release memory: the bytes go aside first
          provisional.aside.assign(static_cast<const char*>(ptr), static_cast<const char*>(ptr) + provisional.requested);
        }
        provisional.taken = Placement{};
      }
      if (placed.block != nullptr) {
        committed = count_placed(mem, device, placed, provisional.requested, stack)->ptr;
        if (committed != ptr) {
          std::memmove(committed, ptr, provisional.requested);
        }
      } else {
        const bool host_memory = provisional.taken.block == nullptr && provisional.aside.empty();
        if (provisional.taken.block != nullptr) {  // shapes mode: giving back returns the pages
          provisional.aside.assign(static_cast<const char*>(ptr), static_cast<const char*>(ptr) + provisional.requested);
          give_back_taken(provisional, mem);
        }
        committed = place_block(mem, device, provisional.requested, pool, stream, stack)->ptr;
        std::memcpy(committed, host_memory ? ptr : provisional.aside.data(), provisional.requested);
        if (host_memory) {
          unback(ptr, provisional.size, mem.card.backing());
        }
      }
    }
  }
  report_block(committed, true);
  return committed;
}

}  // namespace supa
