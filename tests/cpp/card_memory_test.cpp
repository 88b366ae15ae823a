// Unit tests of the emulated card's block policy (supa_emu/csrc/runtime/card_memory.h): request
// rounding, segment sizes, best fit, splitting and whole-block hand-outs, coalescing on free,
// per-stream reuse, oversize blocks, garbage collection, the capacity and host-memory decisions, and
// expandable segments (expandable_segments.h). Plain C++ with no test framework: each case prints
// "ok <name>" or "FAIL <name>" with the failed checks, and the exit status counts the failures.
// Built and run by tests/test_native_allocator_policy.py.
#include "card_memory.h"
#include "expandable_segments.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace {

using supa::BlockPolicy;
using supa::CardBlock;
using supa::CardMemory;
using supa::CardSegment;
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
      : card(0, capacity, [this](const CardSegment& s) { released.push_back({s.ptr, s.size}); }, backing) {}
  ~TestCard() { card.release_cached(); }  // give the host memory back between cases

  // A new or cached block, marked allocated as the caching allocator marks it.
  CardBlock* take(size_t size, const PoolId& pool = kGeneral, const BlockPolicy& policy = BlockPolicy(),
                  int64_t stream = 0) {
    Placement placed = card.place(size, pool, policy, stream);
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
  CHECK(policy.round_size(0) == 512);  // whole 512-byte blocks, no padding
  CHECK(policy.round_size(1) == 512);
  CHECK(policy.round_size(512) == 512);
  CHECK(policy.round_size(513) == 1024);
  CHECK(policy.round_size(1 * MiB) == 1 * MiB);

  BlockPolicy divided;
  divided.divisions[0] = 4;  // [1 MiB, 2 MiB) in quarter steps of the power of two below
  CHECK(divided.round_size(1 * MiB) == 1 * MiB);              // a power of two stays
  CHECK(divided.round_size(1 * MiB + 1) == 1 * MiB + 256 * KiB);
  CHECK(divided.round_size(1 * MiB + 256 * KiB + 1) == 1 * MiB + 512 * KiB);
  CHECK(divided.round_size(2 * MiB + 1) == 2 * MiB + 512);    // next interval: no divisions set
  CHECK(divided.round_size(1000) == 1024);                     // below 1 MiB: 512-byte blocks

  BlockPolicy last_interval;
  last_interval.divisions[supa::kRoundUpIntervals - 1] = 2;  // the last interval is open-ended
  const size_t huge = size_t{1} << 40;
  CHECK(last_interval.round_size(huge + 1) == huge + huge / 2);
}

void segment_sizes() {
  CHECK(supa::segment_size(512) == 2 * MiB);         // small pool: 2 MiB segments
  CHECK(supa::segment_size(1 * MiB) == 2 * MiB);     // 1 MiB is still small
  CHECK(supa::segment_size(1 * MiB + 512) == 20 * MiB);  // large, below 10 MiB: 20 MiB segments
  CHECK(supa::segment_size(10 * MiB - 512) == 20 * MiB);
  CHECK(supa::segment_size(10 * MiB) == 10 * MiB);   // from 10 MiB: rounded up to 2 MiB
  CHECK(supa::segment_size(11 * MiB) == 12 * MiB);
}

void oversize_marks() {
  BlockPolicy policy;
  CHECK(!policy.is_oversize(size_t{1} << 50));  // max_split_size unlimited
  policy.max_split_size = 2 * MiB;
  CHECK(!policy.is_oversize(2 * MiB - 512));
  CHECK(policy.is_oversize(2 * MiB));
}

void small_requests_split_a_segment() {
  TestCard t(64 * MiB);
  CardBlock* a = t.take(512);
  REQUIRE(a != nullptr);
  CHECK(t.last.segment != nullptr && t.last.segment->size == 2 * MiB && t.last.segment->small);
  CHECK(a->size == 512 && a->small && a->is_split());
  CHECK(t.last.inactive_split == 1 && t.last.inactive_split_bytes == int64_t(2 * MiB - 512));
  CardBlock* b = t.take(4096);  // from the remainder, right after `a`
  REQUIRE(b != nullptr);
  CHECK(t.last.segment == nullptr && b->ptr == static_cast<char*>(a->ptr) + 512);
  CHECK(t.last.inactive_split == 0 && t.last.inactive_split_bytes == -4096);
  CHECK(t.card.reserved() == int64_t(2 * MiB) && t.card.cached_blocks() == 1);
  t.card.cache(a);
  t.card.cache(b);
}

void large_request_whole_block_handout() {
  TestCard t(64 * MiB);
  CardBlock* a = t.take(19 * MiB);  // remainder 1 MiB: not more than 1 MiB, so not split
  REQUIRE(a != nullptr);
  CHECK(t.last.segment->size == 20 * MiB && !t.last.segment->small);
  CHECK(a->size == 20 * MiB && !a->is_split());
  CHECK(t.last.inactive_split == 0);
  void* const start = a->ptr;
  t.card.cache(a);
  CardBlock* b = t.take(18 * MiB);  // remainder 2 MiB: split
  REQUIRE(b != nullptr && b->ptr == start);
  CHECK(b->size == 18 * MiB && b->is_split() && t.last.inactive_split == 1);
  CardBlock* c = t.take(2 * MiB);  // the 2 MiB remainder: handed out whole, no new segment
  REQUIRE(c != nullptr && t.last.segment == nullptr);
  CHECK(t.last.inactive_split == -1 && t.last.inactive_split_bytes == -int64_t(2 * MiB));
  CHECK(t.card.reserved() == int64_t(20 * MiB));
  t.card.cache(b);
  t.card.cache(c);
  CHECK(t.card.cached_blocks() == 1);
}

void small_whole_block_below_512_remainder() {
  TestCard t(64 * MiB);
  CardBlock* a = t.take(2 * MiB - 1024);
  REQUIRE(a != nullptr);
  CHECK(!a->small);  // above 1 MiB: the large pool
  CardBlock* s = t.take(1 * MiB);
  CardBlock* rest = t.take(1 * MiB);  // takes the segment's other half exactly
  REQUIRE(s != nullptr && rest != nullptr);
  CHECK(t.last.segment == nullptr && rest->size == 1 * MiB);
  t.card.cache(s);
  CardBlock* whole = t.take(1 * MiB - 256);  // rounds to 1 MiB: s, exactly
  CHECK(whole == s && whole->size == 1 * MiB);
  t.card.cache(whole);
  t.card.cache(rest);
  t.card.cache(a);
}

void best_fit_then_lowest_address() {
  TestCard t(64 * MiB);
  CardBlock* a = t.take(4096);
  CardBlock* gap1 = t.take(1024);
  CardBlock* b = t.take(4096);
  CardBlock* gap2 = t.take(2048);
  CardBlock* c = t.take(4096);
  t.card.cache(gap2);
  t.card.cache(gap1);
  CardBlock* d = t.take(1024);  // the 1 KiB hole fits best, not the 2 KiB one or the remainder
  REQUIRE(d != nullptr);
  CHECK(d->ptr == static_cast<char*>(a->ptr) + 4096);
  for (CardBlock* x : {a, b, c, d}) {
    t.card.cache(x);
  }
  CHECK(t.card.cached_blocks() == 1);  // everything merged back into the one segment
}

void coalescing_on_free() {
  TestCard t(64 * MiB);
  CardBlock* a = t.take(512);
  CardBlock* b = t.take(512);
  CardBlock* c = t.take(512);
  void* const start = a->ptr;
  supa::Release r = t.card.cache(a);
  CHECK(r.inactive_split == 1 && r.inactive_split_bytes == 512);
  r = t.card.cache(c);  // merges with the segment's remainder
  CHECK(r.inactive_split == 0 && r.inactive_split_bytes == 512);
  r = t.card.cache(b);  // merges with both neighbours: the segment is whole again
  CHECK(r.inactive_split == -2 && r.inactive_split_bytes == -int64_t(2 * MiB - 512));
  CHECK(t.card.cached_blocks() == 1);
  CardBlock* whole = t.take(1024);
  REQUIRE(whole != nullptr);
  CHECK(whole->ptr == start && t.last.segment == nullptr);
  t.card.cache(whole);
  t.card.release_cached();
  CHECK(t.released.size() == 1 && t.released[0].second == 2 * MiB && t.card.reserved() == 0);
}

void split_segment_is_not_released() {
  TestCard t(64 * MiB);
  CardBlock* a = t.take(512);
  t.card.release_cached();  // the segment holds an allocated block: it stays
  CHECK(t.released.empty() && t.card.reserved() == int64_t(2 * MiB));
  t.card.cache(a);
  t.card.release_cached();
  CHECK(t.released.size() == 1);
}

void reuse_only_within_pool() {
  TestCard t(64 * MiB);
  const PoolId user{0, 1};
  CardBlock* general = t.take(2048);
  t.card.cache(general);
  CardBlock* pooled = t.take(2048, user);  // the general pool's segment is not the user pool's
  REQUIRE(pooled != nullptr && t.last.segment != nullptr && pooled->pool == user);
  void* const pooled_memory = pooled->ptr;
  t.card.cache(pooled);
  t.card.release_cached(&user);  // empty_cache of one pool leaves the others' segments
  CHECK(t.released.size() == 1 && t.released[0].first == pooled_memory);
  CHECK(t.card.cached_blocks() == 1 && t.card.reserved() == int64_t(2 * MiB));
}

void reuse_only_within_stream() {
  TestCard t(256 * MiB);
  const BlockPolicy policy;
  CardBlock* on_side = t.take(3 * MiB, kGeneral, policy, 7);
  REQUIRE(on_side != nullptr);
  CHECK(on_side->stream == 7 && t.last.segment != nullptr && t.last.segment->stream == 7);
  void* const side_ptr = on_side->ptr;
  t.card.cache(on_side);
  CardBlock* on_default = t.take(3 * MiB);  // the side stream's free segment does not serve it
  REQUIRE(on_default != nullptr);
  CHECK(t.last.segment != nullptr && on_default->ptr != side_ptr && on_default->stream == 0);
  CardBlock* again = t.take(2 * MiB, kGeneral, policy, 7);  // it serves its own stream, split
  REQUIRE(again != nullptr);
  CHECK(t.last.segment == nullptr && again->ptr == side_ptr && again->stream == 7);
  CHECK(again->next != nullptr && again->next->stream == 7);  // the remainder stays the stream's
  t.card.cache(again);
  t.card.cache(on_default);
  t.card.release_cached();  // every stream's whole free segments go back
  CHECK(t.card.reserved() == 0 && t.released.size() == 2);
}

void small_and_large_pools_apart() {
  TestCard t(64 * MiB);
  CardBlock* large = t.take(3 * MiB);
  t.card.cache(large);
  CardBlock* small = t.take(4096);  // the free 20 MiB segment is the large pool's
  REQUIRE(small != nullptr && t.last.segment != nullptr);
  CHECK(t.card.reserved() == int64_t(22 * MiB));
  t.card.cache(small);
}

void oversize_blocks() {
  TestCard t(256 * MiB);
  BlockPolicy policy;
  policy.max_split_size = 4 * MiB;
  CardBlock* big = t.take(30 * MiB, kGeneral, policy);
  REQUIRE(big != nullptr && big->oversize && t.last.segment->oversize);
  CHECK(big->size == 30 * MiB);
  t.card.cache(big);
  REQUIRE(t.take(12 * MiB, kGeneral, policy) == big);  // oversize: served whole, not split
  CHECK(big->size == 30 * MiB && t.last.segment == nullptr);
  t.card.cache(big);
  CardBlock* small_request = t.take(2 * MiB, kGeneral, policy);  // below max_split_size: not from it
  REQUIRE(small_request != nullptr && small_request != big);
  CHECK(t.last.segment != nullptr);
  t.card.cache(small_request);
  CardBlock* fresh = t.take(5 * MiB, kGeneral, policy);  // 25 MiB smaller: beyond kLargeBuffer
  REQUIRE(fresh != nullptr && fresh != big);
  t.card.cache(fresh);
}

void capacity_limit() {
  TestCard t(4 * MiB);
  CardBlock* a = t.take(1 * MiB);
  CardBlock* b = t.take(1 * MiB);
  CardBlock* c = t.take(1 * MiB);  // a second 2 MiB segment
  REQUIRE(a != nullptr && b != nullptr && c != nullptr);
  CHECK(t.card.reserved() == int64_t(4 * MiB));
  CardBlock* d = t.take(1 * MiB);
  CardBlock* e = t.take(512);  // the card is full and nothing is free: out of memory
  CHECK(e == nullptr);
  CHECK(t.last.host_error == 0 && t.last.retries == 1);
  CHECK(t.card.unreserved() == 0);
  for (CardBlock* x : {a, b, c, d}) {
    t.card.cache(x);
  }
  t.card.set_fraction(0.5);  // set_per_process_memory_fraction
  CHECK(t.card.limit() == int64_t(2 * MiB));
  t.card.release_cached();
  CardBlock* within = t.take(2048);
  REQUIRE(within != nullptr);
  CHECK(t.take(2 * MiB) == nullptr);  // a 20 MiB segment does not fit 2 MiB
  t.card.cache(within);
}

void full_card_releases_free_segments() {
  TestCard t(22 * MiB);
  CardBlock* held = t.take(512);
  CardBlock* spare = t.take(3 * MiB);
  t.card.cache(spare);
  CardBlock* small = t.take(1 * MiB);  // fits the small segment's remainder: nothing released
  REQUIRE(small != nullptr && t.last.retries == 0);
  t.card.cache(small);
  t.card.cache(held);
  CardBlock* held2 = t.take(512);
  const PoolId user{0, 1};
  CardBlock* fresh = t.take(3 * MiB, user);  // 22 + 20 MiB > 22 MiB: the free segments go back first
  REQUIRE(fresh != nullptr);
  CHECK(t.last.retries == 1);
  CHECK(t.released.size() == 1 && t.released[0].second == 20 * MiB);
  CHECK(t.card.reserved() == int64_t(22 * MiB));
  t.card.cache(held2);
  t.card.cache(fresh);
}

void garbage_collection_least_recently_freed_first() {
  TestCard t(64 * MiB);
  BlockPolicy policy;
  policy.gc_threshold = 0.5;  // keep reserved memory at or below 32 MiB when it can
  CardBlock* a = t.take(3 * MiB, kGeneral, policy);
  CardBlock* b = t.take(512, kGeneral, policy);
  void* const first_freed = a->ptr;
  t.card.cache(a);
  t.card.cache(b);
  CardBlock* d = t.take(15 * MiB, {0, 1}, policy);  // 22 + 16 > 32 MiB: release until it fits
  REQUIRE(d != nullptr);
  CHECK(t.last.retries == 0);
  CHECK(t.released.size() == 1 && t.released[0].first == first_freed);
  CHECK(t.card.reserved() == int64_t(18 * MiB));
  t.card.cache(d);
}

void host_out_of_memory() {
  TestCard t(int64_t{1} << 62);  // the card has room; the host cannot back the segment
  CardBlock* spare = t.take(512);
  t.card.cache(spare);
  CHECK(t.take(size_t{1} << 50) == nullptr);
  CHECK(t.last.host_error == ENOMEM);
  CHECK(t.last.retries == 1);  // the free segments were given back before the one retry
  CHECK(t.released.size() == 1 && t.card.reserved() == 0);
}

// An operator kernel's first allocation: taken from a free block as place() would hand it out, and given
// back exactly (the card's change count untouched); nothing is reserved for it.
void taken_and_given_back() {
  TestCard t(4 * MiB);
  CardBlock* held = t.take(4 * KiB);
  REQUIRE(held != nullptr);
  t.card.cache(t.take(8 * KiB));
  const uint64_t changes = t.card.changes();
  const size_t free_blocks = t.card.cached_blocks();
  const Placement taken = t.card.take_free(2 * KiB, kGeneral, BlockPolicy(), 0);
  REQUIRE(taken.block != nullptr);
  taken.block->allocated = true;
  void* ptr = taken.block->ptr;
  CHECK(taken.segment == nullptr && t.card.changes() == changes && t.card.reserved() == 2 * MiB);
  CHECK(t.card.take_free(4 * MiB, kGeneral, BlockPolicy(), 0).block == nullptr);  // no free block fits: none
  t.card.give_back(taken.block);
  CHECK(t.card.changes() == changes && t.card.cached_blocks() == free_blocks);
  CHECK(t.take(2 * KiB)->ptr == ptr);  // place() hands out the same block
  CHECK(t.card.changes() == changes + 1);
}

// Random requests, frees, takes and give-backs: each gets the best fit a search of all blocks finds,
// the changes reported add up to the split segments' free blocks (in-place splits keep the order).
void random_requests_take_the_best_fit() {
  TestCard t(64 * MiB);
  auto next = [s = uint64_t{12345}](uint64_t n) mutable { return ((s = s * 6364136223846793005ULL + 1) >> 33) % n; };
  std::vector<CardBlock*> live;
  int64_t reported_blocks = 0, reported_bytes = 0;
  for (int step = 0; step < 6000; ++step) {
    const size_t size = (next(16) + 1) * 512;
    const CardBlock* best = nullptr;
    int64_t blocks = 0, bytes = 0;
    for (const auto& entry : t.card.segments()) {
      for (const CardBlock* b : t.card.blocks_of(*entry.second)) {
        blocks += !b->allocated && b->is_split() ? 1 : 0;
        bytes += !b->allocated && b->is_split() ? static_cast<int64_t>(b->size) : 0;
        best = !b->allocated && b->size >= size && (!best || supa::BlockBySize()(b, best)) ? b : best;
      }
    }
    REQUIRE(blocks == reported_blocks && bytes == reported_bytes);
    void* const expected = best != nullptr ? best->ptr : nullptr;  // (placing may change `best`)
    supa::Release changed;  // the free blocks' change reported
    if (!live.empty() && next(5) < 2) {
      CardBlock* block = std::exchange(live[next(live.size())], live.back());
      live.pop_back();
      changed = next(2) == 0 ? t.card.cache(block) : t.card.give_back(block);
    } else {
      const bool take = next(2) == 0;
      const Placement placed = take ? t.card.take_free(size, kGeneral, BlockPolicy(), 0)
                                    : t.card.place(size, kGeneral, BlockPolicy(), 0);
      REQUIRE(placed.block ? (expected ? placed.block->ptr == expected : !!placed.segment) : !expected && take);
      if (placed.block != nullptr) {
        placed.block->allocated = true;
        live.push_back(placed.block);
        changed = {placed.inactive_split, placed.inactive_split_bytes};
      }
    }
    reported_blocks += changed.inactive_split;
    reported_bytes += changed.inactive_split_bytes;
  }
  std::for_each(live.begin(), live.end(), [&t](CardBlock* block) { t.card.cache(block); });
}

// A block given back is taken again at its address (an operator's result set aside while another
// is placed): the free memory around it stays free, the split counts as take_free's would.
void taken_again_at_its_address() {
  TestCard t(4 * MiB);
  CardBlock* a = t.take(4 * KiB);
  CardBlock* b = t.take(2 * KiB);
  CardBlock* c = t.take(4 * KiB);
  REQUIRE(a != nullptr && b != nullptr && c != nullptr);
  void* at = b->ptr;
  t.card.cache(a);
  t.card.cache(b);  // merged with a: one free block of 6 KiB before c
  const size_t free_blocks = t.card.cached_blocks();
  const Placement taken = t.card.take_at(at, 2 * KiB, BlockPolicy());
  REQUIRE(taken.block != nullptr);
  CHECK(taken.block->ptr == at && taken.block->size == 2 * KiB && taken.segment == nullptr);
  CHECK(taken.inactive_split == 0 && taken.inactive_split_bytes == -2 * int64_t{KiB});  // 6 KiB free -> 4 KiB
  CHECK(t.card.cached_blocks() == free_blocks);  // the 4 KiB before it, free
  taken.block->allocated = true;
  CHECK(t.take(4 * KiB)->ptr == static_cast<char*>(at) - 4 * KiB);
  CHECK(t.card.take_at(c->ptr, 4 * KiB, BlockPolicy()).block == nullptr);  // allocated: not taken
  CHECK(t.card.take_at(at, 2 * KiB, BlockPolicy()).block == nullptr);       // taken already
  t.card.give_back(taken.block);
  // Inside a free block: free memory stays on both sides.
  const Placement middle = t.card.take_at(static_cast<char*>(at) + 512, 512, BlockPolicy());
  REQUIRE(middle.block != nullptr);
  CHECK(middle.inactive_split == 1 && middle.inactive_split_bytes == -512);
}

// Shapes mode's backing: a card larger than the host, and blocks that read zeros when handed out again.
void reserved_address_space_backing() {
  TestCard t(int64_t{1} << 40, supa::Backing::kReservedAddressSpace);
  CardBlock* large = t.take(size_t{64} << 30);  // more than this host has: only address space is reserved
  REQUIRE(large != nullptr);
  CHECK(t.last.host_error == 0);
  static_cast<char*>(large->ptr)[12345] = 7;
  t.card.cache(large);
  large = t.take(size_t{64} << 30);
  REQUIRE(large != nullptr);
  CHECK(t.last.segment == nullptr);
  CHECK(static_cast<char*>(large->ptr)[12345] == 0);  // its pages went back to the host when it was freed
  CardBlock* first = t.take(3 * KiB);  // the start of a small segment, ending inside its first page
  REQUIRE(first != nullptr);
  CardBlock* second = t.take(2 * KiB);  // shares that page
  REQUIRE(second != nullptr && second->ptr == static_cast<char*>(first->ptr) + 3 * KiB);
  static_cast<char*>(first->ptr)[3000] = 7;
  static_cast<char*>(second->ptr)[100] = 9;
  t.card.cache(first);
  REQUIRE(t.take(3 * KiB) == first);
  CHECK(static_cast<char*>(first->ptr)[3000] == 0);  // the partial page of a block handed out is cleared
  CHECK(static_cast<char*>(second->ptr)[100] == 9);  // and nothing beyond the block
  t.card.cache(first);
  t.card.cache(second);
  t.card.cache(large);
}

// Equal free blocks go lowest card address first, whatever the host addresses behind the segments
// (mapped pages come at falling addresses, heap ones in no fixed order): a compute-mode and a
// shapes-mode run of one program pick the same blocks. Segments lie first fit on the card.
void lowest_card_address_whatever_the_host_address() {
  for (const supa::Backing backing : {supa::Backing::kHeap, supa::Backing::kReservedAddressSpace}) {
    TestCard t(64 * MiB, backing);
    CardBlock* a1 = t.take(1 * MiB);
    CardBlock* a2 = t.take(1 * MiB);  // fills the first small segment
    CardBlock* b1 = t.take(1 * MiB);
    CardBlock* b2 = t.take(1 * MiB);
    REQUIRE(a1 && a2 && b1 && b2 && a1->segment != b1->segment);
    CHECK(a1->segment->card_address == 0 && b1->segment->card_address == 2 * MiB);
    CHECK(a2->card_address() == 1 * MiB && b1->card_address() == 2 * MiB);
    t.card.cache(b1);  // freed first, and
    t.card.cache(a1);
    CHECK(t.take(1 * MiB) == a1);  // still the second choice
    t.card.cache(a1);
    t.card.cache(a2);  // the first segment is whole again, and goes back to the host
    t.card.release_cached();
    REQUIRE(t.released.size() == 1);
    CHECK(t.take(1 * MiB) == b1);
    CardBlock* c = t.take(1 * MiB);  // a new segment, where the released one lay
    REQUIRE(c != nullptr && t.last.segment != nullptr);
    CHECK(c->segment->card_address == 0);
    for (CardBlock* x : {c, b1, b2}) {
      t.card.cache(x);
    }
  }
}

// Expandable segments (expandable_segments.h): pages mapped on demand into one range per pool and
// stream, reported as they change; only whole free pages are unmapped, and an empty segment goes.
void expandable_segments_map_and_unmap_pages() {
  TestCard t(100 * MiB);
  std::vector<std::pair<size_t, bool>> changes;  // (bytes, mapped)
  t.card.set_pages_changed([&](const CardSegment& s, void*, size_t size, bool mapped) {
    CHECK(s.expandable() && s.page == 20 * MiB && s.size == supa::expandable_range(100 * MiB, 20 * MiB));
    changes.emplace_back(size, mapped);
  });
  BlockPolicy policy;
  policy.expandable = true;
  CardBlock* a = t.take(10 * MiB, kGeneral, policy);
  REQUIRE(a != nullptr && a->segment->expandable());
  CHECK(t.last.segment == nullptr && t.card.reserved() == int64_t(20 * MiB) && t.last.inactive_split == 0);
  CardBlock* b = t.take(40 * MiB, kGeneral, policy);  // the free 10 MiB and two more pages
  REQUIRE(b != nullptr && b->ptr == static_cast<char*>(a->ptr) + 10 * MiB && b->segment == a->segment);
  CardBlock* c = t.take(10 * MiB - 512, kGeneral, policy);  // fills the third page but 512 bytes: split
  REQUIRE(c != nullptr && c->size == 10 * MiB - 512 && c->next != nullptr && c->next->size == 512);
  CHECK(t.card.reserved() == int64_t(60 * MiB));
  CHECK(t.take(50 * MiB, kGeneral, policy) == nullptr);  // 110 MiB is more than the card
  CHECK(t.last.retries == 1 && t.card.reserved() == int64_t(60 * MiB));
  t.card.cache(b);
  t.card.release_cached();  // b's pages [20, 40) go; the 10 MiB before and after stay mapped
  CHECK(t.card.reserved() == int64_t(40 * MiB) && t.released.empty());
  const std::vector<const CardBlock*> blocks = t.card.blocks_of(*a->segment);
  REQUIRE(blocks.size() == 7);
  CHECK(!blocks[2]->mapped && blocks[2]->size == 20 * MiB && blocks[1]->mapped && blocks[1]->size == 10 * MiB);
  CardBlock* d = t.take(15 * MiB, kGeneral, policy);  // maps the hole again at its lowest address
  REQUIRE(d != nullptr && d->ptr == static_cast<char*>(a->ptr) + 10 * MiB);
  t.card.cache(a);
  t.card.cache(c);
  t.card.cache(d);
  t.card.release_cached();
  CHECK(t.card.reserved() == 0 && t.card.segments().empty());
  const std::vector<std::pair<size_t, bool>> expected = {
      {20 * MiB, true}, {40 * MiB, true}, {20 * MiB, false}, {20 * MiB, true}, {60 * MiB, false}};
  CHECK(changes == expected);
}

// The setting off: blocks of expandable segments serve no request. The process's limit is checked
// against the segment a request would otherwise get, the card against the pages.
void expandable_segments_setting_and_limit() {
  TestCard t(200 * MiB);
  BlockPolicy on;
  on.expandable = true;
  CardBlock* a = t.take(5 * MiB, kGeneral, on);
  REQUIRE(a != nullptr);
  t.card.cache(a);
  CardBlock* b = t.take(5 * MiB);  // the setting off: a segment of its own
  REQUIRE(b != nullptr && !b->segment->expandable() && t.last.segment != nullptr);
  t.card.cache(b);
  t.card.release_cached();
  t.card.set_fraction(0.5);  // 100 MiB
  CardBlock* c = t.take(61 * MiB, kGeneral, on);  // maps 80 MiB
  REQUIRE(c != nullptr && t.card.reserved() == int64_t(80 * MiB));
  CHECK(t.take(22 * MiB, kGeneral, on) == nullptr);  // 80 + 22 is over the limit, though 19 MiB are free
  CardBlock* d = t.take(19 * MiB, kGeneral, on);  // fits the free 19 MiB
  REQUIRE(d != nullptr && t.card.reserved() == int64_t(80 * MiB));
  t.card.cache(c);
  t.card.cache(d);
}

}  // namespace

int main() {
  const std::vector<std::pair<const char*, std::function<void()>>> cases = {
      {"round_up_sizes", round_up_sizes},
      {"segment_sizes", segment_sizes},
      {"oversize_marks", oversize_marks},
      {"small_requests_split_a_segment", small_requests_split_a_segment},
      {"large_request_whole_block_handout", large_request_whole_block_handout},
      {"small_whole_block_below_512_remainder", small_whole_block_below_512_remainder},
      {"best_fit_then_lowest_address", best_fit_then_lowest_address},
      {"coalescing_on_free", coalescing_on_free},
      {"split_segment_is_not_released", split_segment_is_not_released},
      {"reuse_only_within_pool", reuse_only_within_pool},
      {"reuse_only_within_stream", reuse_only_within_stream},
      {"small_and_large_pools_apart", small_and_large_pools_apart},
      {"oversize_blocks", oversize_blocks},
      {"capacity_limit", capacity_limit},
      {"full_card_releases_free_segments", full_card_releases_free_segments},
      {"garbage_collection_least_recently_freed_first", garbage_collection_least_recently_freed_first},
      {"host_out_of_memory", host_out_of_memory},
      {"taken_and_given_back", taken_and_given_back},
      {"taken_again_at_its_address", taken_again_at_its_address},
      {"random_requests_take_the_best_fit", random_requests_take_the_best_fit},
      {"reserved_address_space_backing", reserved_address_space_backing},
      {"lowest_card_address_whatever_the_host_address", lowest_card_address_whatever_the_host_address},
      {"expandable_segments_map_and_unmap_pages", expandable_segments_map_and_unmap_pages},
      {"expandable_segments_setting_and_limit", expandable_segments_setting_and_limit},
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
