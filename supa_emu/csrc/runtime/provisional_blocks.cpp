// An operator kernel's allocations (allocate_provisional), which the card counts only once the
// operator hands them back as results (commit_block): until then a provisional block is host
// memory of its rounded size, or a free block of the card taken as the card would hand it out now
// (CardMemory::take_free) and left uncounted. A block freed before it is committed (the kernel's
// own scratch) goes back where it came from, and the card's statistics, history and cache are as
// they were. The results thus reach the card's figures in the order they are committed.
#include "provisional_blocks.h"

#include "allocator_state.h"
#include "caching_allocator.h"
#include "device_guard.h"
#include "devices.h"
#include "mem_pool.h"
#include "memory_history.h"

#include <cerrno>
#include <cstring>
#include <vector>

namespace supa {

namespace allocator_state {
namespace {

// An operator kernel's allocation not yet handed back as a result: host memory of its rounded size.
struct ProvisionalBlock {
  size_t size;
  size_t requested;
  c10::DeviceIndex device;
  // Or a block of the card taken as place() would hand it out now (CardMemory::take_free), while the
  // card had made `changes` changes: uncounted until committed.
  Placement taken;
  uint64_t changes = 0;
};
std::unordered_map<void*, ProvisionalBlock> g_provisional;  // under g_mutex

}  // namespace

bool drop_provisional(void* ptr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_provisional.find(ptr);
  if (it == g_provisional.end()) {
    return false;
  }
  CardMemory& card = memory_of(it->second.device).card;
  if (CardBlock* block = it->second.taken.block) {
    card.give_back(block);
  } else {
    unback(ptr, it->second.size, card.backing());
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
      g_provisional.emplace(block->ptr, ProvisionalBlock{size, nbytes, device, taken, mem.card.changes()});
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
    const ProvisionalBlock provisional = it->second;
    g_provisional.erase(it);
    DeviceMemory& mem = memory_of(device);
    if (provisional.taken.block != nullptr && provisional.changes == mem.card.changes()) {
      // The card is as it was when the block was taken: placing the request now gives this block.
      committed = count_placed(mem, device, provisional.taken, provisional.requested, stack)->ptr;
    } else if (provisional.taken.block != nullptr && mem.card.backing() == Backing::kHeap &&
               (placed = mem.card.place_after_give_back(provisional.taken.block, provisional.size, pool, g_policy,
                                                        stream)).block != nullptr) {
      // The card changed meanwhile: placed anew among its free blocks, where nothing wrote the
      // given-back bytes, which move within the card's memory if the block is elsewhere.
      committed = count_placed(mem, device, placed, provisional.requested, stack)->ptr;
      if (committed != ptr) {
        std::memmove(committed, ptr, provisional.requested);
      }
    } else {
      // Placed anew, possibly reserving or releasing memory: the bytes of a block taken from the
      // card go to the side first (in shapes mode giving it back also returns its pages).
      std::vector<char> bytes;
      const void* source = ptr;
      if (provisional.taken.block != nullptr) {
        bytes.assign(static_cast<const char*>(ptr), static_cast<const char*>(ptr) + provisional.requested);
        source = bytes.data();
        if (mem.card.backing() != Backing::kHeap) {  // under heap backing place_after_give_back gave it back
          mem.card.give_back(provisional.taken.block);
        }
      }
      committed = place_block(mem, device, provisional.requested, pool, stream, stack)->ptr;
      std::memcpy(committed, source, provisional.requested);
      if (provisional.taken.block == nullptr) {
        unback(ptr, provisional.size, mem.card.backing());
      }
    }
  }
  report_block(committed, true);
  return committed;
}

}  // namespace supa
