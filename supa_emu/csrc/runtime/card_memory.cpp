// The emulated card's memory and block policy (see card_memory.h).
#include "card_memory.h"

#include <algorithm>
#include <cstdlib>

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
  if (step == 0) {
    return floor << 1;
  }
  return ((size + step - 1) / step) * step;
}

}  // namespace

size_t BlockPolicy::round_size(size_t nbytes) const {
  const size_t padded = nbytes + kPadding;
  size_t interval = 0;
  while (interval + 1 < kRoundUpIntervals && (kRoundUpStart << (interval + 1)) <= padded) {
    ++interval;
  }
  const size_t steps = divisions[interval];
  if (steps > 1 && padded > kMinBlockSize * steps) {
    return round_to_division(padded, steps);
  }
  return ((padded + kMinBlockSize - 1) / kMinBlockSize) * kMinBlockSize;
}

bool BlockPolicy::is_oversize(size_t size) const {
  return max_split_size >= 0 && size >= static_cast<size_t>(max_split_size);
}

CardMemory::CardMemory(int device, int64_t capacity, SegmentReleased on_release)
    : device_(device), capacity_(capacity), on_release_(std::move(on_release)) {}

int64_t CardMemory::limit() const {
  return static_cast<int64_t>(fraction_ * static_cast<double>(capacity_));
}

int64_t CardMemory::unreserved() const {
  return std::max<int64_t>(0, capacity_ - reserved_);
}

// Of the request's size, the most recently freed block, whose memory is the likeliest to be in
// the CPU's caches still (taking the oldest made a convolution on supa 10% slower than on CPU
// tensors, where malloc hands back the freshest memory).
std::multimap<size_t, CardBlock*>::iterator CardMemory::find_cached(size_t size, const PoolId& pool,
                                                                   const BlockPolicy& policy) {
  const auto [same_size, larger] = cached_.equal_range(size);
  for (auto it = larger; it != same_size;) {
    if ((--it)->second->pool == pool) {
      return it;
    }
  }
  if (policy.is_oversize(size)) {
    for (auto it = larger; it != cached_.end() && it->first < size + kLargeBuffer; ++it) {
      if (it->second->pool == pool) {
        return it;
      }
    }
  }
  return cached_.end();
}

void CardMemory::release(CardBlock* block) {
  on_release_(*block);
  reserved_ -= static_cast<int64_t>(block->size);
  std::free(block->ptr);
  delete block;
}

void CardMemory::release_cached(const PoolId* pool) {
  for (auto it = cached_.begin(); it != cached_.end();) {
    CardBlock* block = it->second;
    if (pool != nullptr && block->pool != *pool) {
      ++it;
      continue;
    }
    it = cached_.erase(it);
    release(block);
  }
}

// Once reserved memory passes the threshold's share of the limit, cached blocks go back to the
// host, least recently freed first, until it is below again.
void CardMemory::collect_garbage(size_t incoming, const BlockPolicy& policy) {
  const auto target = static_cast<int64_t>(policy.gc_threshold * static_cast<double>(limit()));
  if (policy.gc_threshold <= 0.0 || reserved_ + static_cast<int64_t>(incoming) <= target) {
    return;
  }
  std::vector<std::multimap<size_t, CardBlock*>::iterator> by_age;
  for (auto it = cached_.begin(); it != cached_.end(); ++it) {
    by_age.push_back(it);
  }
  std::sort(by_age.begin(), by_age.end(),
            [](const auto& a, const auto& b) { return a->second->freed_at < b->second->freed_at; });
  for (auto it : by_age) {
    if (reserved_ + static_cast<int64_t>(incoming) <= target) {
      break;
    }
    CardBlock* block = it->second;
    cached_.erase(it);
    release(block);
  }
}

Placement CardMemory::place(size_t size, const PoolId& pool, const BlockPolicy& policy) {
  Placement placed;
  if (auto hit = find_cached(size, pool, policy); hit != cached_.end()) {
    placed.block = hit->second;
    placed.from_cache = true;
    cached_.erase(hit);
    return placed;
  }
  collect_garbage(size, policy);
  if (reserved_ + static_cast<int64_t>(size) > limit() && !cached_.empty()) {
    placed.retries++;
    release_cached();
  }
  if (reserved_ + static_cast<int64_t>(size) > limit()) {
    return placed;
  }
  void* ptr = nullptr;
  if (const int error = posix_memalign(&ptr, kMemoryAlignment, size); error != 0) {
    if (!cached_.empty()) {  // cached blocks hold host memory too: give it back and retry once
      placed.retries++;
      release_cached();
    }
    if (ptr == nullptr && posix_memalign(&ptr, kMemoryAlignment, size) != 0) {
      placed.host_error = error;
      return placed;
    }
  }
  placed.block = new CardBlock{ptr, size, 0, device_, false, pool};
  placed.block->oversize = policy.is_oversize(size);
  reserved_ += static_cast<int64_t>(size);
  return placed;
}

void CardMemory::cache(CardBlock* block) {
  block->allocated = false;
  block->freed_at = ++frees_;
  cached_.emplace(block->size, block);
}

}  // namespace supa
