// The emulated card's memory and block policy (see card_memory.h).
#include "card_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace supa {

namespace {

// The next of `divisions` equal steps between the powers of two around `size`.
size_t round_to_division(size_t size, size_t divisions) {
  size_t floor = 1;
  while ((floor << 1) <= size) {
    floor <<= 1;
  }
  if (floor == size) {
    return size;
  }
  const size_t step = floor / divisions;
  return step == 0 ? floor << 1 : ((size + step - 1) / step) * step;
}

}  // namespace

size_t BlockPolicy::round_size(size_t nbytes) const {
  if (nbytes < kMinBlockSize) {
    return kMinBlockSize;
  }
  size_t interval = 0;
  while (interval + 1 < kRoundUpIntervals && (kRoundUpStart << (interval + 1)) <= nbytes) {
    ++interval;
  }
  const size_t steps = divisions[interval];
  if (steps > 1 && nbytes > kMinBlockSize * steps) {
    return round_to_division(nbytes, steps);
  }
  return ((nbytes + kMinBlockSize - 1) / kMinBlockSize) * kMinBlockSize;
}

bool BlockPolicy::is_oversize(size_t size) const {
  return max_split_size >= 0 && size >= static_cast<size_t>(max_split_size);
}

bool BlockPolicy::may_serve(size_t block_size, size_t size) const {
  if (max_split_size < 0) {
    return true;
  }
  if (!is_oversize(size)) {
    return !is_oversize(block_size);  // no oversize block for a request below max_split_size
  }
  return block_size < size + kLargeBuffer;  // an oversize one only a little larger than the request
}

size_t segment_size(size_t size) {
  if (size <= kSmallSize) {
    return kSmallBuffer;
  }
  if (size < kMinLargeAlloc) {
    return kLargeBuffer;
  }
  return ((size + kRoundLarge - 1) / kRoundLarge) * kRoundLarge;
}

CardMemory::CardMemory(int device, int64_t capacity, SegmentReleased on_release, Backing backing,
                       PoolRules pool_rules)
    : device_(device),
      capacity_(capacity),
      on_release_(std::move(on_release)),
      pool_rules_(std::move(pool_rules)),
      backing_(backing) {}

int64_t CardMemory::limit() const {
  return static_cast<int64_t>(fraction_ * static_cast<double>(capacity_));
}

int64_t CardMemory::unreserved() const {
  return std::max<int64_t>(0, capacity_ - reserved_);
}

size_t CardMemory::cached_blocks() const {
  size_t n = 0;
  for (const auto& entry : free_) {
    n += entry.second.size();
  }
  return n;
}

const CardSegment* CardMemory::segment_of(const void* ptr) const {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  auto it = segments_.upper_bound(address);
  if (it == segments_.begin()) {
    return nullptr;
  }
  --it;
  return address < it->first + it->second->size ? it->second : nullptr;
}

std::vector<const CardBlock*> CardMemory::blocks_of(const CardSegment& segment) const {
  std::vector<const CardBlock*> blocks;
  for (const CardBlock* b = segment.first; b != nullptr; b = b->next) {
    blocks.push_back(b);
  }
  return blocks;
}

// Gives a whole free segment back to the host; the block is out of the free lists already.
void CardMemory::release(CardBlock* block) {
  CardSegment* segment = block->segment;
  on_release_(*segment);
  reserved_ -= static_cast<int64_t>(segment->size);
  segments_.erase(reinterpret_cast<uintptr_t>(segment->ptr));
  addresses_.give_back(segment->card_address);
  unback(segment->ptr, segment->size, backing_);
  delete segment;
  delete_block(block);
}

void CardMemory::release_cached(const PoolId* pool, bool for_oom) {
  const auto kept = [&](const PoolId& owner) {
    if (pool != nullptr) {
      return owner != *pool;
    }
    const bool in_use = pool_rules_.in_use && pool_rules_.in_use(owner);
    return in_use && !(for_oom && pool_rules_.use_on_oom && pool_rules_.use_on_oom(owner));
  };
  ++changes_;
  std::vector<CardBlock*> expandable;  // their whole free pages are unmapped (this changes the lists)
  for (auto& entry : free_) {
    if (kept(std::get<0>(entry.first))) {
      continue;
    }
    FreeBlocks& blocks = entry.second;
    for (auto it = blocks.begin(); it != blocks.end();) {
      CardBlock* block = *it;
      if (block->is_split()) {  // as an expandable segment's blocks always are (its range is never all mapped)
        if (block->segment->expandable()) {
          expandable.push_back(block);
        }
        ++it;
        continue;
      }
      it = blocks.erase(it);
      release(block);
    }
  }
  for (CardBlock* block : expandable) {
    unmap_free_pages(block);
  }
}

// With max_split_size set, the free oversize segments of the pool and stream that make room for
// `size`: the smallest that is large enough, else the largest ones until their sum is.
bool CardMemory::release_oversize(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy) {
  if (policy.max_split_size < 0) {
    return false;
  }
  FreeBlocks& blocks = free_blocks(pool, false, stream);
  const size_t wanted = std::max(size, static_cast<size_t>(policy.max_split_size));
  CardBlock key{nullptr, wanted, 0, device_, false};
  for (auto it = blocks.lower_bound(&key); it != blocks.end(); ++it) {
    if (!(*it)->is_split()) {
      CardBlock* block = *it;
      blocks.erase(it);
      release(block);
      return true;
    }
  }
  size_t released = 0;
  auto it = blocks.lower_bound(&key);
  while (released < wanted && it != blocks.begin()) {
    --it;
    CardBlock* block = *it;
    if (!policy.is_oversize(block->size)) {
      break;
    }
    if (block->is_split()) {
      continue;
    }
    released += block->size;
    it = blocks.erase(it);
    release(block);
  }
  return released >= wanted;
}

// Once reserved memory passes the threshold's share of the limit, whole free segments go back
// to the host, least recently freed first, until it is below again.
void CardMemory::collect_garbage(size_t incoming, const BlockPolicy& policy) {
  const auto target = static_cast<int64_t>(policy.gc_threshold * static_cast<double>(limit()));
  if (policy.gc_threshold <= 0.0 || reserved_ + static_cast<int64_t>(incoming) <= target) {
    return;
  }
  std::vector<std::pair<FreeBlocks*, CardBlock*>> by_age;
  for (auto& entry : free_) {
    for (CardBlock* block : entry.second) {
      if (!block->is_split()) {
        by_age.emplace_back(&entry.second, block);
      }
    }
  }
  std::sort(by_age.begin(), by_age.end(),
            [](const auto& a, const auto& b) { return a.second->freed_at < b.second->freed_at; });
  for (auto [blocks, block] : by_age) {
    if (reserved_ + static_cast<int64_t>(incoming) <= target) {
      break;
    }
    blocks->erase(block);
    release(block);
  }
}

// New memory for a request of `size`, as one free block: a new segment, or with expandable segments
// pages mapped into one; on a full card the oversize free segments, then every whole free segment
// (and expandable segments' free pages), go back first.
CardBlock* CardMemory::reserve(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy,
                               Placement& placed) {
  // A pool whose blocks are never split keeps a segment per block, expandable segments or not.
  const bool expandable = policy.expandable && !(pool_rules_.no_split && pool_rules_.no_split(pool));
  const auto attempt = [&] {
    return expandable ? grow_expandable(size, pool, stream, placed) : new_segment(size, pool, stream, policy, placed);
  };
  CardBlock* block = attempt();
  if (block == nullptr && release_oversize(size, pool, stream, policy)) {
    block = attempt();
  }
  if (block == nullptr) {
    placed.retries++;
    release_cached(nullptr, /*for_oom=*/true);
    block = attempt();
  }
  return block;
}

// A segment of its own for a request of `size` (host_error: the host could not back one that fits).
CardBlock* CardMemory::new_segment(size_t size, const PoolId& pool, int64_t stream, const BlockPolicy& policy,
                                   Placement& placed) {
  const size_t bytes = segment_size(size);
  placed.host_error = 0;
  if (reserved_ + static_cast<int64_t>(bytes) > limit()) {
    return nullptr;
  }
  void* ptr = back(bytes, backing_);
  if (ptr == nullptr) {
    placed.host_error = errno;
    return nullptr;
  }
  const bool small = size <= kSmallSize;
  auto* segment = new CardSegment{ptr, bytes, device_, pool, small, policy.is_oversize(bytes), stream};
  segment->free_list = &free_blocks(pool, small, stream);
  CardBlock like{nullptr, 0, 0, device_, false, pool, small};
  like.stream = stream;
  like.segment = segment;
  CardBlock* block = new_block(ptr, bytes, like);
  segment->first = block;
  segment->card_address = addresses_.take(bytes);
  segments_.emplace(reinterpret_cast<uintptr_t>(ptr), segment);
  reserved_ += static_cast<int64_t>(bytes);
  placed.segment = segment;
  return block;
}

Placement CardMemory::place(size_t size, const PoolId& pool, const BlockPolicy& policy, int64_t stream) {
  ++changes_;
  Placement placed;
  if (hand_out_free(size, pool, stream, policy, placed)) {
    return placed;
  }
  collect_garbage(segment_size(size), policy);
  if (CardBlock* block = reserve(size, pool, stream, policy, placed)) {
    hand_out(block, size, policy, placed);
  }
  return placed;
}

Placement CardMemory::take_free(size_t size, const PoolId& pool, const BlockPolicy& policy, int64_t stream) {
  Placement placed;
  hand_out_free(size, pool, stream, policy, placed);
  return placed;
}

Placement CardMemory::place_after_give_back(CardBlock* taken, size_t size, const PoolId& pool,
                                            const BlockPolicy& policy, int64_t stream, Release& given_back) {
  given_back = give_back(taken);
  Placement placed;
  if (hand_out_free(size, pool, stream, policy, placed)) {
    ++changes_;
  }
  return placed;
}

void CardMemory::drop_pages(const CardBlock& block) const {
  if (backing_ != Backing::kReservedAddressSpace) {
    return;
  }
  const auto begin = reinterpret_cast<uintptr_t>(block.ptr);
  const uintptr_t first = (begin + host_page_size() - 1) & ~(host_page_size() - 1);
  const uintptr_t last = (begin + block.size) & ~(host_page_size() - 1);
  if (first < last) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }
}

// The pages wholly inside a free block were dropped (drop_pages) or never written: only the
// partial pages at the block's ends may hold old bytes.
void CardMemory::clear(const CardBlock& block) const {
  if (backing_ != Backing::kReservedAddressSpace) {
    return;
  }
  const auto begin = reinterpret_cast<uintptr_t>(block.ptr);
  const uintptr_t end = begin + block.size;
  const uintptr_t first = std::min(end, (begin + host_page_size() - 1) & ~(host_page_size() - 1));
  const uintptr_t last = std::max(first, end & ~(host_page_size() - 1));
  std::memset(block.ptr, 0, first - begin);
  std::memset(reinterpret_cast<void*>(last), 0, end - last);
}

}  // namespace supa
