// The table of the addresses the caching allocator handed out (block_table.h).
#include "block_table.h"

#include "card_memory.h"

#include <algorithm>
#include <cstdint>

namespace supa {

namespace {
constexpr size_t kSpareNodes = 8;  // per shard
}  // namespace

BlockTable::Shard& BlockTable::shard(const void* ptr) const {
  // Blocks are 512-byte aligned: the bits above those spread them over the shards.
  return shards_[(reinterpret_cast<uintptr_t>(ptr) >> 9) % kShards];
}

BlockTable::Owners& BlockTable::entry(Shard& s, const void* ptr) {
  if (auto it = s.owners.find(ptr); it != s.owners.end()) {
    return it->second;
  }
  if (s.spare.empty()) {
    return s.owners[ptr];
  }
  OwnersMap::node_type node = std::move(s.spare.back());
  s.spare.pop_back();
  node.key() = ptr;
  node.mapped() = Owners{};
  return s.owners.insert(std::move(node)).position->second;
}

void BlockTable::forget_if_unowned(Shard& s, OwnersMap::iterator it) {
  const auto unowned = [](const Owners& owners) { return owners.block == nullptr && owners.provisional == nullptr; };
  if (!unowned(it->second)) {
    return;
  }
  const auto kept = s.unowned.begin(), kept_end = kept + s.unowned_count;
  if (std::find(kept, kept_end, it->first) != kept_end) {
    return;
  }
  if (s.unowned_count == kKeptUnowned) {  // the oldest goes, unless something holds its address again
    const void* oldest = s.unowned[0];
    std::move(kept + 1, kept_end, kept);
    --s.unowned_count;
    if (auto old = s.owners.find(oldest); old != s.owners.end() && unowned(old->second)) {
      if (s.spare.size() < kSpareNodes) {
        s.spare.push_back(s.owners.extract(old));
      } else {
        s.owners.erase(old);
      }
    }
  }
  s.unowned[s.unowned_count++] = it->first;
}

template <typename T>
void BlockTable::add(const void* ptr, T* Owners::*slot, T* value) {
  Shard& s = shard(ptr);
  std::lock_guard<LightMutex> lock(s.mutex);
  T*& held = entry(s, ptr).*slot;
  TORCH_INTERNAL_ASSERT(held == nullptr, "supa_emu: two blocks of one kind handed out at one address");
  held = value;
}

template <typename T>
T* BlockTable::remove(const void* ptr, T* Owners::*slot) {
  Shard& s = shard(ptr);
  std::lock_guard<LightMutex> lock(s.mutex);
  auto it = s.owners.find(ptr);
  if (it == s.owners.end() || it->second.*slot == nullptr) {
    return nullptr;
  }
  T* held = std::exchange(it->second.*slot, nullptr);
  forget_if_unowned(s, it);
  return held;
}

template <typename T>
T* BlockTable::find(const void* ptr, T* Owners::*slot) const {
  Shard& s = shard(ptr);
  std::lock_guard<LightMutex> lock(s.mutex);
  auto it = s.owners.find(ptr);
  return it == s.owners.end() ? nullptr : it->second.*slot;
}

void BlockTable::add_block(CardBlock* block) {
  add(block->ptr, &Owners::block, block);
}

CardBlock* BlockTable::remove_block(const void* ptr) {
  return remove(ptr, &Owners::block);
}

CardBlock* BlockTable::find_block(const void* ptr) const {
  return find(ptr, &Owners::block);
}

void BlockTable::add_provisional(void* ptr, ProvisionalBlock* block) {
  add(ptr, &Owners::provisional, block);
}

ProvisionalBlock* BlockTable::remove_provisional(const void* ptr) {
  return remove(ptr, &Owners::provisional);
}

ProvisionalBlock* BlockTable::find_provisional(const void* ptr) const {
  return find(ptr, &Owners::provisional);
}

}  // namespace supa
