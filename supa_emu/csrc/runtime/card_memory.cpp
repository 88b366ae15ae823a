// The emulated card's memory and block policy (see card_memory.h).
#include "card_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
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

CardMemory::CardMemory(int device, int64_t capacity, SegmentReleased on_release, Backing backing)
    : device_(device), capacity_(capacity), on_release_(std::move(on_release)), backing_(backing) {}

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

bool CardMemory::lazily_backed(size_t size) const {
  return backing_ == Backing::kReservedAddressSpace && size >= kReservedBackingMin;
}

void* CardMemory::back(size_t size) {
  if (lazily_backed(size)) {
    // MAP_NORESERVE: not counted against the host's commit limit, so a card larger than the host
    // can be planned; pages cost host RAM only once written.
    void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return ptr == MAP_FAILED ? nullptr : ptr;
  }
  void* ptr = nullptr;
  if (const int error = posix_memalign(&ptr, kMemoryAlignment, size); error != 0) {
    errno = error;
    return nullptr;
  }
  return ptr;
}

void CardMemory::unback(void* ptr, size_t size) {
  if (lazily_backed(size)) {
    munmap(ptr, size);
  } else {
    std::free(ptr);
  }
}

void CardMemory::release(CardBlock* block) {
  on_release_(*block);
  reserved_ -= static_cast<int64_t>(block->size);
  unback(block->ptr, block->size);
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

// Room for a new segment of `size`: after garbage collection and, when the card is full, releasing
// its whole cache once.
bool CardMemory::make_room(size_t size, const BlockPolicy& policy, int* retries) {
  collect_garbage(size, policy);
  if (reserved_ + static_cast<int64_t>(size) > limit() && !cached_.empty()) {
    ++*retries;
    release_cached();
  }
  return reserved_ + static_cast<int64_t>(size) <= limit();
}

Placement CardMemory::place(size_t size, const PoolId& pool, const BlockPolicy& policy) {
  Placement placed;
  if (auto hit = find_cached(size, pool, policy); hit != cached_.end()) {
    placed.block = hit->second;
    placed.from_cache = true;
    cached_.erase(hit);
    clear_if_reused_heap(placed.block);
    return placed;
  }
  if (!make_room(size, policy, &placed.retries)) {
    return placed;
  }
  void* ptr = back(size);
  if (ptr == nullptr) {
    const int error = errno;  // set by back()
    if (!cached_.empty()) {  // cached blocks hold host memory too: give it back and retry once
      placed.retries++;
      release_cached();
    }
    ptr = back(size);
    if (ptr == nullptr) {
      placed.host_error = error;
      return placed;
    }
  }
  placed.block = new CardBlock{ptr, size, 0, device_, false, pool};
  placed.block->oversize = policy.is_oversize(size);
  reserved_ += static_cast<int64_t>(size);
  clear_if_reused_heap(placed.block);
  return placed;
}

void CardMemory::clear_if_reused_heap(CardBlock* block) const {
  if (backing_ == Backing::kReservedAddressSpace && !lazily_backed(block->size)) {
    std::memset(block->ptr, 0, block->size);
  }
}

CardBlock* CardMemory::take_cached(size_t size, const PoolId& pool, const BlockPolicy& policy) {
  auto hit = find_cached(size, pool, policy);
  if (hit == cached_.end()) {
    return nullptr;
  }
  CardBlock* block = hit->second;
  cached_.erase(hit);
  return block;
}

void CardMemory::put_back(CardBlock* block) {
  if (lazily_backed(block->size)) {
    madvise(block->ptr, block->size, MADV_DONTNEED);
  }
  cached_.emplace(block->size, block);  // freed_at unchanged: its place in the cache as before
}

bool CardMemory::admit(CardBlock* block, const BlockPolicy& policy, int* retries) {
  if (!make_room(block->size, policy, retries)) {
    return false;
  }
  block->is_segment = true;
  block->oversize = policy.is_oversize(block->size);
  reserved_ += static_cast<int64_t>(block->size);
  return true;
}

void CardMemory::cache(CardBlock* block) {
  block->allocated = false;
  block->freed_at = ++frees_;
  put_back(block);
}

}  // namespace supa
