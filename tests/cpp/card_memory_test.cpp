// Unit tests of the emulated card's block policy (supa_emu/csrc/runtime/card_memory.h): request
// rounding, no splitting or coalescing, which cached block a request reuses, garbage collection,
// and the capacity and host-memory decisions. Plain C++ with no test framework: each case prints
// "ok <name>" or "FAIL <name>" with the failed checks, and the exit status counts the failures.
// Built and run by tests/test_native_allocator_policy.py.
#include "card_memory.h"

#include <cerrno>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

using supa::BlockPolicy;
using supa::CardBlock;
using supa::CardMemory;
using supa::Placement;
using supa::PoolId;

constexpr size_t KiB = 1024;
constexpr size_t MiB = 1024 * KiB;
constexpr PoolId kGeneral{0, 0};

int g_failed_checks = 0;

bool check(bool ok, int line, const char* what) {
  if (!ok) {
    std::printf("  line %d: %s failed\n", line, what);
    ++g_failed_checks;
  }
  return ok;
}

// CHECK records a failure and goes on; REQUIRE ends the case, for checks the rest depends on.
#define CHECK(cond) check((cond), __LINE__, "CHECK(" #cond ")")
#define REQUIRE(cond)                                        \
  do {                                                       \
    if (!check((cond), __LINE__, "REQUIRE(" #cond ")")) {    \
      return;                                                \
    }                                                        \
  } while (0)

// A card whose released segments are remembered (by address and size, in release order).
struct TestCard {
  explicit TestCard(int64_t capacity, supa::Backing backing = supa::Backing::kHeap)
      : card(0, capacity, [this](const CardBlock& b) { released.push_back({b.ptr, b.size}); }, backing) {}
  ~TestCard() { card.release_cached(); }  // give the host memory back between cases

  // A new or cached block, marked allocated as the caching allocator marks it.
  CardBlock* take(size_t size, const PoolId& pool = kGeneral, const BlockPolicy& policy = BlockPolicy()) {
    Placement placed = card.place(size, pool, policy);
    if (placed.block != nullptr) {
      placed.block->allocated = true;
    }
    last = placed;
    return placed.block;
  }

  CardMemory card;
  Placement last;
  std::vector<std::pair<void*, size_t>> released;
};

void round_up_sizes() {
  const BlockPolicy policy;
  CHECK(policy.round_size(0) == 512);          // 32 bytes of padding, then whole 512-byte blocks
  CHECK(policy.round_size(1) == 512);
  CHECK(policy.round_size(480) == 512);        // 480 + 32 fills one block exactly
  CHECK(policy.round_size(481) == 1024);
  CHECK(policy.round_size(1 * MiB) == 1 * MiB + 512);

  BlockPolicy divided;
  divided.divisions[0] = 4;  // [1 MiB, 2 MiB) in quarter steps of the power of two below
  CHECK(divided.round_size(1 * MiB - 32) == 1 * MiB);              // a power of two stays
  CHECK(divided.round_size(1 * MiB + 1 - 32) == 1 * MiB + 256 * KiB);
  CHECK(divided.round_size(1 * MiB + 256 * KiB + 1 - 32) == 1 * MiB + 512 * KiB);
  CHECK(divided.round_size(2 * MiB + 1 - 32) == 2 * MiB + 512);    // next interval: no divisions set
  CHECK(divided.round_size(1000) == 1536);                          // below 1 MiB: 512-byte blocks

  BlockPolicy last_interval;
  last_interval.divisions[supa::kRoundUpIntervals - 1] = 2;  // the last interval is open-ended
  const size_t huge = size_t{1} << 40;
  CHECK(last_interval.round_size(huge + 1 - 32) == huge + huge / 2);
}

void oversize_marks() {
  BlockPolicy policy;
  CHECK(!policy.is_oversize(size_t{1} << 50));  // max_split_size unlimited
  policy.max_split_size = 2 * MiB;
  CHECK(!policy.is_oversize(2 * MiB - 512));
  CHECK(policy.is_oversize(2 * MiB));
}

// A request of `size` gets a new segment, not a cached block, leaving `reserved` reserved.
void expect_new_segment(TestCard& t, size_t size, int64_t reserved) {
  CardBlock* block = t.take(size);
  REQUIRE(block != nullptr);
  CHECK(!t.last.from_cache);
  CHECK(t.card.reserved() == reserved);
  t.card.cache(block);
}

void no_split() {
  TestCard t(1 * MiB);
  t.card.cache(t.take(4096));
  expect_new_segment(t, 1024, 4096 + 1024);  // a cached block larger than the request is not split for it
  CHECK(t.card.cached_blocks() == 2);
}

void no_coalescing() {
  TestCard t(1 * MiB);
  CardBlock* a = t.take(512);
  CardBlock* b = t.take(512);
  t.card.cache(a);
  t.card.cache(b);
  expect_new_segment(t, 1024, 2048);  // two free 512-byte blocks do not merge to serve it
}

void reuse_most_recently_freed() {
  TestCard t(1 * MiB);
  CardBlock* first = t.take(2048);
  CardBlock* second = t.take(2048);
  CardBlock* third = t.take(2048);
  t.card.cache(second);
  t.card.cache(first);
  t.card.cache(third);
  REQUIRE(t.take(2048) == third);  // the most recently freed block of the size, then the next
  CHECK(t.last.from_cache);
  REQUIRE(t.take(2048) == first);
  REQUIRE(t.take(2048) == second);
  CHECK(t.card.reserved() == 3 * 2048);  // all served from the cache: nothing new reserved
  t.card.cache(first);
  t.card.cache(second);
  t.card.cache(third);
}

void reuse_only_within_pool() {
  TestCard t(1 * MiB);
  const PoolId user{0, 1};
  CardBlock* general = t.take(2048);
  t.card.cache(general);
  CardBlock* pooled = t.take(2048, user);  // the general pool's block is not the user pool's
  REQUIRE(pooled != general && !t.last.from_cache && pooled->pool == user);
  t.card.cache(pooled);
  REQUIRE(t.take(2048) == general);
  REQUIRE(t.take(2048, user) == pooled);
  t.card.cache(general);
  t.card.cache(pooled);
  void* const pooled_memory = pooled->ptr;
  t.card.release_cached(&user);  // empty_cache of one pool leaves the others' blocks
  CHECK(t.released.size() == 1 && t.released[0].first == pooled_memory);
  CHECK(t.card.cached_blocks() == 1 && t.card.reserved() == 2048);
}

void oversize_reuse_of_larger_block() {
  TestCard t(64 * MiB);
  BlockPolicy policy;
  policy.max_split_size = 1 * MiB;
  CardBlock* big = t.take(3 * MiB, kGeneral, policy);
  REQUIRE(big != nullptr && big->oversize);
  t.card.cache(big);
  REQUIRE(t.take(2 * MiB, kGeneral, policy) == big);  // oversize: a larger block serves it whole
  CHECK(t.last.from_cache);
  t.card.cache(big);
  CardBlock* own = t.take(2 * MiB);  // without max_split_size the request gets a block of its size
  REQUIRE(own != nullptr && own != big);
  CHECK(!t.last.from_cache && !own->oversize);
  t.card.cache(own);
  t.card.release_cached();
  CardBlock* huge = t.take(23 * MiB, kGeneral, policy);
  REQUIRE(huge != nullptr);
  t.card.cache(huge);
  CardBlock* fresh = t.take(2 * MiB, kGeneral, policy);  // 21 MiB larger: beyond kLargeBuffer
  REQUIRE(fresh != nullptr && fresh != huge);
  CHECK(!t.last.from_cache);
  t.card.cache(fresh);
}

void capacity_limit() {
  TestCard t(4096);
  CardBlock* a = t.take(2048);
  CardBlock* b = t.take(2048);
  REQUIRE(a != nullptr && b != nullptr);
  CHECK(t.card.reserved() == 4096);
  CHECK(t.take(512) == nullptr);  // the card is full and nothing is cached: out of memory
  CHECK(t.last.host_error == 0 && t.last.retries == 0);
  CHECK(t.card.unreserved() == 0);
  t.card.cache(a);
  t.card.cache(b);
  t.card.set_fraction(0.5);  // set_per_process_memory_fraction
  CHECK(t.card.limit() == 2048);
  t.card.release_cached();
  CardBlock* within = t.take(2048);
  REQUIRE(within != nullptr);
  CHECK(t.take(512) == nullptr);
  t.card.cache(within);
}

void full_card_releases_cache_once() {
  TestCard t(4096);
  CardBlock* held = t.take(2048);
  CardBlock* spare = t.take(1024);
  t.card.cache(spare);
  CardBlock* fresh = t.take(2048);  // 3072 + 2048 > 4096: the cache goes back to the host first
  REQUIRE(fresh != nullptr);
  CHECK(!t.last.from_cache);
  CHECK(t.last.retries == 1);
  CHECK(t.released.size() == 1 && t.released[0].second == 1024);
  CHECK(t.card.reserved() == 4096 && t.card.cached_blocks() == 0);
  t.card.cache(held);
  t.card.cache(fresh);
}

void garbage_collection_least_recently_freed_first() {
  TestCard t(8192);
  BlockPolicy policy;
  policy.gc_threshold = 0.5;  // keep reserved memory at or below 4096 when it can
  CardBlock* a = t.take(1024, kGeneral, policy);
  CardBlock* b = t.take(1024, kGeneral, policy);
  CardBlock* c = t.take(1024, kGeneral, policy);
  void* const first_freed = a->ptr;
  t.card.cache(a);
  t.card.cache(c);
  t.card.cache(b);
  CardBlock* d = t.take(2048, kGeneral, policy);  // 3072 + 2048 > 4096: release until it fits
  REQUIRE(d != nullptr);
  CHECK(t.last.retries == 0);
  CHECK(t.released.size() == 1 && t.released[0].first == first_freed);
  CHECK(t.card.cached_blocks() == 2 && t.card.reserved() == 4096);
  t.card.cache(d);
}

void host_out_of_memory() {
  TestCard t(int64_t{1} << 62);  // the card has room; the host cannot back the block
  CardBlock* spare = t.take(512);
  t.card.cache(spare);
  CHECK(t.take(size_t{1} << 50) == nullptr);
  CHECK(t.last.host_error == ENOMEM);
  CHECK(t.last.retries == 1);  // the cache was given back before the one retry
  CHECK(t.released.size() == 1 && t.card.reserved() == 0);
}

// An operator kernel's allocation taken from the cache and given back leaves the card as it was.
void provisional_block_from_the_cache() {
  TestCard t(1 * MiB);
  CardBlock* block = t.take(2048);
  t.card.cache(block);
  const uint64_t age = block->freed_at;
  REQUIRE(t.card.take_cached(2048, kGeneral, BlockPolicy()) == block);
  CHECK(t.card.cached_blocks() == 0 && t.card.reserved() == 2048);
  CHECK(t.card.take_cached(2048, kGeneral, BlockPolicy()) == nullptr);  // no second one; nothing new reserved
  t.card.put_back(block);
  CHECK(block->freed_at == age && t.card.cached_blocks() == 1 && t.card.reserved() == 2048);
  REQUIRE(t.take(2048) == block);
  CHECK(t.last.from_cache);
  t.card.cache(block);
}

// Host memory of the card's backing that is not a segment yet, as a kernel's allocation gets it.
CardBlock* unplaced_block(TestCard& t, size_t size) {
  CardBlock* block = new CardBlock{t.card.back(size), size, 0, 0, false, kGeneral};
  block->is_segment = false;
  return block;
}

// Host memory a kernel wrote its result into becomes a segment as a new one would, or does not fit.
void admitted_memory_becomes_a_segment() {
  TestCard t(4096);
  CardBlock* held = t.take(2048);
  t.card.cache(t.take(1024));
  CardBlock* result = unplaced_block(t, 2048);
  REQUIRE(result->ptr != nullptr);
  CHECK(t.card.reserved() == 3072);  // not the card's yet
  int retries = 0;
  REQUIRE(t.card.admit(result, BlockPolicy(), &retries));  // 3072 + 2048 > 4096: the cache goes back first
  CHECK(retries == 1 && t.released.size() == 1 && t.card.reserved() == 4096 && result->is_segment);
  CardBlock* more = unplaced_block(t, 512);
  CHECK(!t.card.admit(more, BlockPolicy(), &retries));  // the card is full: out of memory
  CHECK(t.card.reserved() == 4096 && !more->is_segment);
  t.card.unback(more->ptr, more->size);
  delete more;
  t.card.cache(held);
  t.card.cache(result);
}

// Shapes mode's backing: a card larger than the host, and blocks that read zeros when handed out again.
void reserved_address_space_backing() {
  TestCard t(int64_t{1} << 40, supa::Backing::kReservedAddressSpace);
  CardBlock* large = t.take(size_t{64} << 30);  // more than this host has: only address space is reserved
  REQUIRE(large != nullptr);
  CHECK(t.last.host_error == 0);
  static_cast<char*>(large->ptr)[12345] = 7;
  t.card.cache(large);
  REQUIRE(t.take(size_t{64} << 30) == large);
  CHECK(static_cast<char*>(large->ptr)[12345] == 0);  // its pages went back to the host when it was cached
  CardBlock* small = t.take(1024);
  REQUIRE(small != nullptr);
  static_cast<char*>(small->ptr)[100] = 7;
  t.card.cache(small);
  REQUIRE(t.take(1024) == small);
  CHECK(static_cast<char*>(small->ptr)[100] == 0);  // a heap block is cleared when handed out again
  t.card.cache(small);
  t.card.cache(large);
}

}  // namespace

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> cases = {
      {"round_up_sizes", round_up_sizes},
      {"oversize_marks", oversize_marks},
      {"no_split", no_split},
      {"no_coalescing", no_coalescing},
      {"reuse_most_recently_freed", reuse_most_recently_freed},
      {"reuse_only_within_pool", reuse_only_within_pool},
      {"oversize_reuse_of_larger_block", oversize_reuse_of_larger_block},
      {"capacity_limit", capacity_limit},
      {"full_card_releases_cache_once", full_card_releases_cache_once},
      {"garbage_collection_least_recently_freed_first", garbage_collection_least_recently_freed_first},
      {"host_out_of_memory", host_out_of_memory},
      {"provisional_block_from_the_cache", provisional_block_from_the_cache},
      {"admitted_memory_becomes_a_segment", admitted_memory_becomes_a_segment},
      {"reserved_address_space_backing", reserved_address_space_backing},
  };
  int failed_cases = 0;
  for (const auto& [name, run] : cases) {
    const int before = g_failed_checks;
    run();
    const bool ok = g_failed_checks == before;
    failed_cases += ok ? 0 : 1;
    std::printf("%s %s\n", ok ? "ok" : "FAIL", name);
    std::fflush(stdout);
  }
  std::printf("%zu cases, %d failed\n", cases.size(), failed_cases);
  return failed_cases == 0 ? 0 : 1;
}
