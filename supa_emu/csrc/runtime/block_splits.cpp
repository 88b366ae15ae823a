// Splits and merges of the card's free blocks (block_splits.h): CardMemory's members for them, under
// the caller's serialisation as the rest of the card's.
#include "block_splits.h"

#include <iterator>
#include <utility>

namespace supa {

// Hands out the smallest free block of the pool and stream that holds `size` (then the lowest card
// address), if the max_split_size rules let it serve the request, split to it where they allow;
// false when none does.
bool CardMemory::hand_out_free(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy,
                               Placement& placed) {
  FreeBlocks& blocks = free_blocks(pool, size <= kSmallSize, stream);
  auto it = blocks.lower_bound(BlockOrder{size, 0});
  if (it != blocks.end() && (*it)->segment->expandable()) {
    it = expandable_choice(blocks, it, policy);
  }
  if (it == blocks.end() || !policy.may_serve((*it)->size, size)) {
    return false;
  }
  CardBlock* block = *it;
  if (!block->segment->expandable() && splits(*block, size, policy)) {
    split_front(blocks, it, size, policy, placed);
    return true;
  }
  erase_free(blocks, it);
  hand_out(block, size, policy, placed);
  return true;
}

Release CardMemory::give_back(CardBlock* block) {
  block->allocated = false;
  block->requested = 0;
  return merge_freed(block);  // its age is the free block's it came from
}

Placement CardMemory::take_at(void* ptr, size_t size, const BlockPolicy& policy) {
  Placement placed;
  const CardSegment* segment = segment_of(ptr);
  char* const begin = static_cast<char*>(ptr);
  CardBlock* block = segment == nullptr ? nullptr : segment->first;
  while (block != nullptr && static_cast<char*>(block->ptr) + block->size <= begin) {
    block = block->next;
  }
  if (block == nullptr || block->allocated || !block->mapped ||
      static_cast<char*>(block->ptr) + block->size < begin + size) {
    return placed;
  }
  FreeBlocks& blocks = free_blocks_of(*block);
  erase_free(blocks, block);
  if (block->is_split()) {
    placed.inactive_split -= 1;
    placed.inactive_split_bytes -= static_cast<int64_t>(block->size);
  }
  const auto carve_free = [&](void* at, size_t bytes, bool before) {
    insert_free(blocks, carve(block, at, bytes, before));  // the free memory before or after the range
    placed.inactive_split += 1;
    placed.inactive_split_bytes += static_cast<int64_t>(bytes);
  };
  if (const size_t front = static_cast<size_t>(begin - static_cast<char*>(block->ptr)); front > 0) {
    block->ptr = ptr;
    block->size -= front;
    carve_free(begin - front, front, true);
  }
  if (const size_t after = block->size - size; after > 0) {
    block->size = size;
    carve_free(begin + size, after, false);
  }
  block->oversize = policy.is_oversize(block->size);
  clear(*block);
  placed.block = block;
  if (block->segment->expandable()) {
    placed.inactive_split = 0;
    placed.inactive_split_bytes = 0;
  }
  return placed;
}

CardBlock* CardMemory::carve(CardBlock* block, void* at, size_t bytes, bool before) {
  CardBlock* rest = new_block(at, bytes, *block);
  if (before) {
    rest->prev = block->prev;
    rest->next = block;
    (block->prev != nullptr ? block->prev->next : block->segment->first) = rest;
    block->prev = rest;
  } else {
    rest->prev = block;
    rest->next = block->next;
    if (block->next != nullptr) {
      block->next->prev = rest;
    }
    block->next = rest;
  }
  return rest;
}

// Whether a free block handed out for a request of `size` is split (its remainder stays free).
bool CardMemory::splits(const CardBlock& block, size_t size, const BlockPolicy& policy) const {
  const size_t remaining = block.size - size;
  // With expandable_segments on, blocks of the large pool split as the small pool's do (as CUDA's).
  return !(pool_rules_.no_split && pool_rules_.no_split(block.pool)) &&
         (block.small || policy.expandable ? remaining >= kMinBlockSize
                                           : !policy.is_oversize(size) && remaining > kSmallSize);
}

// The free blocks' change when a free block (of a split segment: `already_split`) is split to a
// request of `size`, with `remaining` bytes left free.
void CardMemory::count_split(bool already_split, size_t size, size_t remaining, Placement& placed) {
  if (already_split) {  // a free block of a split segment shrinks
    placed.inactive_split_bytes -= static_cast<int64_t>(size);
  } else {  // a segment is split: its remainder is a new free block
    placed.inactive_split += 1;
    placed.inactive_split_bytes += static_cast<int64_t>(remaining);
  }
}

// Splits `block` (free, out of the free lists) to `size` where the rules allow.
void CardMemory::hand_out(CardBlock* block, size_t size, const BlockPolicy& policy, Placement& placed) {
  const bool already_split = block->is_split();
  if (splits(*block, size, policy)) {
    const size_t remaining = block->size - size;
    CardBlock* rest = carve(block, static_cast<char*>(block->ptr) + size, remaining, /*before=*/false);
    block->size = size;
    insert_free(free_blocks_of(*rest), rest);
    count_split(already_split, size, remaining, placed);
  } else if (already_split) {  // a free block of a split segment is handed out whole
    placed.inactive_split -= 1;
    placed.inactive_split_bytes -= static_cast<int64_t>(block->size);
  }
  block->oversize = policy.is_oversize(block->size);
  clear(*block);
  placed.block = block;
  if (block->segment->expandable()) {  // inactive_split leaves out expandable segments, as CUDA's
    placed.inactive_split = 0;
    placed.inactive_split_bytes = 0;
  }
}

// hand_out's split of the free block at `it` of a segment that is not expandable, with the
// remainder in the block's list entry: a new block takes the front `size` bytes (and the free
// block's last request, as the block handed out keeps it until it is counted), the free block the
// rest, as a fresh remainder has it. Its entry moves only if the remainder is now smaller than a
// free block before it.
void CardMemory::split_front(FreeBlocks& blocks, FreeBlocks::iterator it, size_t size, const BlockPolicy& policy,
                             Placement& placed) {
  CardBlock* rest = *it;
  const bool already_split = rest->is_split();
  CardBlock* block = carve(rest, rest->ptr, size, /*before=*/true);
  block->requested = rest->requested;
  rest->ptr = static_cast<char*>(rest->ptr) + size;
  rest->size -= size;
  rest->requested = 0;
  rest->oversize = false;
  if (it != blocks.begin() && !BlockBySize()(*std::prev(it), rest)) {
    FreeBlocks::node_type node = blocks.extract(it);
    blocks.insert(std::move(node));
  }
  count_split(already_split, size, rest->size, placed);
  block->oversize = policy.is_oversize(size);
  clear(*block);
  placed.block = block;
}

Release CardMemory::cache(CardBlock* block) {
  ++changes_;
  block->allocated = false;  // it keeps the size of its last request, as CUDA's free blocks do
  block->freed_at = ++frees_;
  return merge_freed(block);
}

// Puts a block back among the free ones, merged with its free neighbours.
Release CardMemory::merge_free(CardBlock* block) {
  Release changed;
  FreeBlocks& blocks = free_blocks_of(*block);
  for (CardBlock* neighbour : {block->prev, block->next}) {
    if (neighbour == nullptr || neighbour->allocated || !neighbour->mapped) {
      continue;
    }
    erase_free(blocks, neighbour);
    if (neighbour == block->prev) {
      block->ptr = neighbour->ptr;
      block->prev = neighbour->prev;
      if (block->prev != nullptr) {
        block->prev->next = block;
      } else {
        block->segment->first = block;
      }
    } else {
      block->next = neighbour->next;
      if (block->next != nullptr) {
        block->next->prev = block;
      }
    }
    block->size += neighbour->size;
    changed.inactive_split -= 1;
    changed.inactive_split_bytes -= static_cast<int64_t>(neighbour->size);
    delete_block(neighbour);
  }
  insert_free(blocks, block);
  drop_pages(*block);
  if (block->segment->expandable()) {
    return {};  // inactive_split leaves out expandable segments, as CUDA's
  }
  if (block->is_split()) {
    changed.inactive_split += 1;
    changed.inactive_split_bytes += static_cast<int64_t>(block->size);
  }
  return changed;
}

// merge_free for a block freed or given back: when exactly one neighbour is free (and the segment is
// not expandable), that neighbour's object and list entry become the merged block, with the freed
// block's attributes (its last request, age and oversize mark), and `block` goes. The entry moves
// only if the merged block is now larger than a free block after it.
Release CardMemory::merge_freed(CardBlock* block) {
  const auto free_neighbour = [](CardBlock* b) { return b != nullptr && !b->allocated && b->mapped ? b : nullptr; };
  CardBlock* const prev = free_neighbour(block->prev);
  CardBlock* const next = free_neighbour(block->next);
  if (block->segment->expandable() || (prev == nullptr) == (next == nullptr)) {
    return merge_free(block);
  }
  CardBlock* const kept = prev != nullptr ? prev : next;
  FreeBlocks& blocks = free_blocks_of(*block);
  const auto it = blocks.find(kept);
  if (it == blocks.end()) {
    return merge_free(block);
  }
  Release changed{-1, -static_cast<int64_t>(kept->size)};
  if (kept == next) {
    kept->ptr = block->ptr;
    kept->prev = block->prev;
    (block->prev != nullptr ? block->prev->next : block->segment->first) = kept;
  } else {
    kept->next = block->next;
    if (block->next != nullptr) {
      block->next->prev = kept;
    }
  }
  kept->size += block->size;
  kept->requested = block->requested;
  kept->freed_at = block->freed_at;
  kept->oversize = block->oversize;
  if (const auto after = std::next(it); after != blocks.end() && !BlockBySize()(kept, *after)) {
    FreeBlocks::node_type node = blocks.extract(it);
    blocks.insert(std::move(node));
  }
  delete_block(block);
  drop_pages(*kept);
  if (kept->is_split()) {
    changed.inactive_split += 1;
    changed.inactive_split_bytes += static_cast<int64_t>(kept->size);
  }
  return changed;
}

}  // namespace supa
