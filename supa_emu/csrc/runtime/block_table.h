// Whose pointer is this: every address the caching allocator has handed out, with what holds it,
// looked up by the free, the fallback's results, the device-of-pointer hook and the memory
// checker. Sharded, each shard under its own lock, as PyTorch's CUDA allocator keeps its allocated
// blocks; the cards' state is each card's own (card_allocator.h).
//
// An address has at most one counted block and at most one provisional block (an operator
// kernel's, provisional_blocks.cpp): a provisional block is here while the address is its own; set
// aside while another result of its operator is placed, it leaves and comes back with its address,
// or, where the card handed that on, stays out (DisplacedBlock). Which one a free means is said by
// its deleter.
#pragma once

#include "light_mutex.h"

#include <c10/util/Exception.h>

#include <array>
#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace supa {

struct CardBlock;
struct ProvisionalBlock;

class BlockTable {
 public:
  void add_block(CardBlock* block);  // at block->ptr
  CardBlock* remove_block(const void* ptr);  // null when none starts there
  CardBlock* find_block(const void* ptr) const;
  // Calls `read(block)` under the table's lock when a counted block starts at `ptr` (for a caller
  // that does not hold the block, which another thread may free meanwhile); whether one does.
  template <typename Read>
  bool read_block(const void* ptr, Read&& read) const {
    Shard& s = shard(ptr);
    std::lock_guard<LightMutex> lock(s.mutex);
    auto it = s.owners.find(ptr);
    if (it == s.owners.end() || it->second.block == nullptr) {
      return false;
    }
    read(*it->second.block);
    return true;
  }
  void add_provisional(void* ptr, ProvisionalBlock* block);
  ProvisionalBlock* remove_provisional(const void* ptr);
  ProvisionalBlock* find_provisional(const void* ptr) const;
  // The provisional block at `ptr` out of the table when `claim(block, counted)`, called under the
  // table's lock, says so, with the counted block it sets (if any) in its place (committed where it
  // is): a commit's one look-up. Null when there is none or it is not claimed.
  template <typename Claim>
  ProvisionalBlock* claim_provisional(const void* ptr, Claim&& claim) {
    Shard& s = shard(ptr);
    std::lock_guard<LightMutex> lock(s.mutex);
    auto it = s.owners.find(ptr);
    ProvisionalBlock* const block = it == s.owners.end() ? nullptr : it->second.provisional;
    CardBlock* counted = nullptr;
    if (block == nullptr || !claim(*block, counted)) {
      return nullptr;
    }
    it->second.provisional = nullptr;
    if (counted != nullptr) {
      TORCH_INTERNAL_ASSERT(it->second.block == nullptr, "supa_emu: two blocks of one kind handed out at one address");
      it->second.block = counted;
    } else {
      forget_if_unowned(s, it);
    }
    return block;
  }

 private:
  struct Owners {
    CardBlock* block = nullptr;
    ProvisionalBlock* provisional = nullptr;
  };
  using OwnersMap = std::unordered_map<const void*, Owners>;
  static constexpr size_t kKeptUnowned = 8;  // per shard
  struct Shard {
    mutable LightMutex mutex;
    OwnersMap owners;
    // Nodes of addresses that left, reused by the next to come: an operator's result handed out
    // and freed on every call costs the heap nothing.
    std::vector<OwnersMap::node_type> spare;
    // The last addresses left with nothing at them, oldest first: their entries stay for the next
    // block at them (an operator's result freed and placed again at one address every call costs
    // no removal and insertion).
    std::array<const void*, kKeptUnowned> unowned{};
    size_t unowned_count = 0;
  };
  // The entry of `ptr` in `s`, made if there is none; the entry at `it`, when nothing holds its
  // address any more, kept among the shard's last unowned ones or gone (under the shard's lock).
  static Owners& entry(Shard& s, const void* ptr);
  static void forget_if_unowned(Shard& s, OwnersMap::iterator it);
  static constexpr size_t kShards = 16;
  Shard& shard(const void* ptr) const;
  template <typename T>
  void add(const void* ptr, T* Owners::*slot, T* value);
  template <typename T>
  T* remove(const void* ptr, T* Owners::*slot);
  template <typename T>
  T* find(const void* ptr, T* Owners::*slot) const;
  mutable std::array<Shard, kShards> shards_;
};

}  // namespace supa
