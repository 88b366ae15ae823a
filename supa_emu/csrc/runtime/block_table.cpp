// The table of the addresses the caching allocator handed out (block_table.h).
#include "block_table.h"

#include "card_memory.h"

#include <c10/util/Exception.h>

#include <cstdint>

namespace supa {

BlockTable::Shard& BlockTable::shard(const void* ptr) const {
  // Blocks are 512-byte aligned: the bits above those spread them over the shards.
  return shards_[(reinterpret_cast<uintptr_t>(ptr) >> 9) % kShards];
}

void BlockTable::add_block(CardBlock* block) {
  Shard& s = shard(block->ptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  Owners& owners = s.owners[block->ptr];
  TORCH_INTERNAL_ASSERT(owners.block == nullptr, "supa_emu: two blocks handed out at one address");
  owners.block = block;
}

CardBlock* BlockTable::remove_block(const void* ptr) {
  Shard& s = shard(ptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.owners.find(ptr);
  if (it == s.owners.end() || it->second.block == nullptr) {
    return nullptr;
  }
  CardBlock* block = it->second.block;
  if (it->second.provisional == nullptr) {
    s.owners.erase(it);
  } else {
    it->second.block = nullptr;
  }
  return block;
}

CardBlock* BlockTable::find_block(const void* ptr) const {
  Shard& s = shard(ptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.owners.find(ptr);
  return it == s.owners.end() ? nullptr : it->second.block;
}

void BlockTable::add_provisional(void* ptr, ProvisionalBlock* block) {
  Shard& s = shard(ptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  Owners& owners = s.owners[ptr];
  TORCH_INTERNAL_ASSERT(owners.provisional == nullptr, "supa_emu: two provisional blocks at one address");
  owners.provisional = block;
}

ProvisionalBlock* BlockTable::remove_provisional(const void* ptr) {
  Shard& s = shard(ptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.owners.find(ptr);
  if (it == s.owners.end() || it->second.provisional == nullptr) {
    return nullptr;
  }
  ProvisionalBlock* block = it->second.provisional;
  if (it->second.block == nullptr) {
    s.owners.erase(it);
  } else {
    it->second.provisional = nullptr;
  }
  return block;
}

void BlockTable::commit_in_place(CardBlock* block) {
  Shard& s = shard(block->ptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  Owners& owners = s.owners.at(block->ptr);
  TORCH_INTERNAL_ASSERT(owners.block == nullptr, "supa_emu: two blocks handed out at one address");
  owners.provisional = nullptr;
  owners.block = block;
}

ProvisionalBlock* BlockTable::find_provisional(const void* ptr) const {
  Shard& s = shard(ptr);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.owners.find(ptr);
  return it == s.owners.end() ? nullptr : it->second.provisional;
}

}  // namespace supa
