// Expandable segments (see expandable_segments.h): CardMemory's members for them, run under the
// caller's serialisation as the rest of the card's.
#include "expandable_segments.h"

#include "card_memory.h"

#include <algorithm>
#include <cerrno>
#include <iterator>

namespace supa {

size_t expandable_page(bool small) {
  return small ? kSmallBuffer : kLargeBuffer;
}

size_t expandable_range(int64_t capacity, size_t page) {
  const auto bytes = static_cast<size_t>(std::max<int64_t>(capacity, 0));
  const size_t pages = (bytes + bytes / 8 + page - 1) / page;
  return std::max<size_t>(pages, 1) * page;
}

// find_free's choice when its best fit is a block of an expandable segment.
FreeBlocks::iterator CardMemory::expandable_choice(FreeBlocks& blocks, FreeBlocks::iterator it,
                                                               const BlockPolicy& policy) const {
  if (!policy.expandable) {  // the setting is off: only blocks of other segments serve
    while (it != blocks.end() && (*it)->segment->expandable()) {
      ++it;
    }
    return it;
  }
  const auto growable = [](const CardBlock* block) {
    return block->size + (block->next != nullptr && !block->next->mapped ? block->next->size : 0);
  };
  for (auto next = std::next(it);
       next != blocks.end() && (*it)->segment->expandable() && growable(*next) < growable(*it); ++next) {
    it = next;
  }
  return it;
}

// Free memory for a request of `size`, as one free block out of the free lists: pages mapped into
// the pool's expandable segment of the stream. Null when the limit or the card has no room.
CardBlock* CardMemory::grow_expandable(size_t size, const PoolId& pool, int64_t stream, Placement& placed) {
  placed.host_error = 0;
  // As CUDA's: the process's limit is checked against the segment a request would otherwise get,
  // the card (below) against the pages mapped, which may pass the limit by part of a page.
  if (fraction_ < 1.0 && reserved_ + static_cast<int64_t>(segment_size(size)) > limit()) {
    return nullptr;
  }
  CardBlock* block = expandable_room(size, pool, stream, placed);
  if (block == nullptr || (!block->mapped && !map_pages(block, std::min(block->size, size), placed))) {
    return nullptr;
  }
  // A free block followed by unmapped space: map what it lacks, each mapping merged with it.
  while (block->size < size) {
    CardBlock* next = block->next;
    if (!map_pages(next, std::min(size - block->size, next->size), placed)) {
      return nullptr;
    }
    block = next;
  }
  free_blocks_of(*block).erase(block);
  return block;
}

// Where a request of `size` goes: the lowest unmapped range of the pool and stream that, with the
// free block before it and the free or unmapped blocks after it, holds `size` (that free block
// when there is one), else the unmapped range of a new expandable segment.
CardBlock* CardMemory::expandable_room(size_t size, const PoolId& pool, int64_t stream, Placement& placed) {
  const bool small = size <= kSmallSize;
  const auto holds = [size](const CardBlock* block) {
    size_t bytes = 0;
    for (; block != nullptr && !block->allocated && bytes < size; block = block->next) {
      bytes += block->size;
    }
    return bytes >= size;
  };
  UnmappedBlocks& unmapped = unmapped_[FreeKey{pool, small, stream}];
  for (CardBlock* range : unmapped) {
    CardBlock* start = range->prev != nullptr && !range->prev->allocated ? range->prev : range;
    if (holds(start)) {
      return start;
    }
  }
  const size_t page = expandable_page(small);
  const size_t bytes = expandable_range(capacity_, page);
  void* ptr = reserve_address_range(bytes);
  if (ptr == nullptr) {
    placed.host_error = errno;
    return nullptr;
  }
  auto* segment = new CardSegment{ptr, bytes, device_, pool, small, false, stream};
  segment->page = page;
  segment->free_list = &free_blocks(pool, small, stream);
  segment->card_address = addresses_.take(bytes);
  auto* block = new CardBlock{ptr, bytes, 0, device_, false, pool, small};
  block->stream = stream;
  block->segment = segment;
  block->mapped = false;
  segment->first = block;
  segments_.emplace(reinterpret_cast<uintptr_t>(ptr), segment);
  unmapped.insert(block);
  return block;
}

// Maps the pages that hold the first `bytes` of the unmapped `block` (which starts on a page): they
// become a free block, merged with the free blocks beside it; the rest stays unmapped. False when
// the card has no room for them (or the host refused them: host_error).
bool CardMemory::map_pages(CardBlock* block, size_t bytes, Placement& placed) {
  CardSegment* segment = block->segment;
  const size_t mapped = (bytes + segment->page - 1) / segment->page * segment->page;
  if (reserved_ + static_cast<int64_t>(mapped) > capacity_) {
    return false;
  }
  if (!map_range(block->ptr, mapped)) {
    placed.host_error = errno;
    return false;
  }
  unmapped_blocks_of(*block).erase(block);
  if (mapped < block->size) {
    CardBlock* rest = carve(block, static_cast<char*>(block->ptr) + mapped, block->size - mapped, false);
    rest->mapped = false;
    unmapped_blocks_of(*rest).insert(rest);
    block->size = mapped;
  }
  block->mapped = true;
  reserved_ += static_cast<int64_t>(mapped);
  if (pages_changed_) {
    pages_changed_(*segment, block->ptr, mapped, true);
  }
  merge_free(block);
  return true;
}

// Unmaps the whole pages inside the free `block` (in the free lists): the memory before and after
// them stays free blocks; the unmapped range merges with the unmapped ranges beside it, and a
// segment left with nothing mapped goes back to the host.
void CardMemory::unmap_free_pages(CardBlock* block) {
  CardSegment* segment = block->segment;
  const auto base = reinterpret_cast<uintptr_t>(segment->ptr);
  const auto begin = reinterpret_cast<uintptr_t>(block->ptr);
  const uintptr_t first = base + (begin - base + segment->page - 1) / segment->page * segment->page;
  const uintptr_t last = base + (begin + block->size - base) / segment->page * segment->page;
  if (first >= last) {
    return;
  }
  FreeBlocks& blocks = free_blocks_of(*block);
  blocks.erase(block);
  if (first > begin) {
    blocks.insert(carve(block, block->ptr, first - begin, true));
  }
  if (const uintptr_t end = begin + block->size; end > last) {
    blocks.insert(carve(block, reinterpret_cast<void*>(last), end - last, false));
  }
  block->ptr = reinterpret_cast<void*>(first);
  block->size = last - first;
  block->mapped = false;
  unmap_range(block->ptr, block->size);
  reserved_ -= static_cast<int64_t>(block->size);
  if (pages_changed_) {
    pages_changed_(*segment, block->ptr, block->size, false);
  }
  UnmappedBlocks& unmapped = unmapped_blocks_of(*block);
  for (CardBlock* neighbour : {block->prev, block->next}) {
    if (neighbour == nullptr || neighbour->mapped) {
      continue;
    }
    unmapped.erase(neighbour);
    if (neighbour == block->prev) {
      block->ptr = neighbour->ptr;
      block->prev = neighbour->prev;
      (block->prev != nullptr ? block->prev->next : segment->first) = block;
    } else {
      block->next = neighbour->next;
      if (block->next != nullptr) {
        block->next->prev = block;
      }
    }
    block->size += neighbour->size;
    delete neighbour;
  }
  if (block->is_split()) {
    unmapped.insert(block);
    return;
  }
  segments_.erase(reinterpret_cast<uintptr_t>(segment->ptr));
  addresses_.give_back(segment->card_address);
  release_address_range(segment->ptr, segment->size);
  delete segment;
  delete block;
}

}  // namespace supa
