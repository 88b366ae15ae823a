// An operator kernel's allocations, counted by the card only once handed back as results (see
// provisional_blocks.cpp).
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace supa {

struct CardBlock;

// An operator kernel's allocation on `device`: host memory that the card does not count until
// commit_block() (a result the operator hands back); freed before that (the kernel's own
// scratch) it leaves the card's statistics, history and cache as they were. Only the results of
// an operator thus reach the card's figures, placed in the order they are committed.
// `from_card`: the block the card would hand out now, if a free one fits (committed without a
// copy when placing its request then hands out the same block; see provisional_blocks.cpp);
// otherwise host memory. Its DataPtr's deleter is delete_provisional.
void* allocate_provisional(size_t nbytes, c10::DeviceIndex device, bool from_card = false);
void delete_provisional(void* ptr);
// Frees `ptr` when it is a provisional block (a raw delete of the host allocator): whether it was.
bool drop_provisional(void* ptr);
// The calling thread starts an operator call: its blocks taken from now on are that call's (those
// set aside when one of its results must be placed anew).
void begin_operator_allocations();
// Places the provisional block at `ptr` on `device` as a request made now and returns the card's
// block: the block itself when it was taken from the card and the card has not changed since;
// otherwise a block its bytes move to, and the provisional memory goes back (the caller drops
// `ptr` without freeing it). Null when `ptr` is not a provisional block of `device`.
void* commit_block(void* ptr, c10::DeviceIndex device);

// An operator kernel's allocation not yet handed back as a result (the card's, card_allocator.h).
struct ProvisionalBlock {
  size_t size;  // rounded
  size_t requested;
  c10::DeviceIndex device;
  uint64_t call;  // the operator call that allocated it (begin_operator_allocations)
  // A block of the card taken as place() would hand it out now, while the card had made `changes`
  // changes, as the `index`th take since then; null: host memory of `size` bytes at the block's
  // address, or (`aside` not empty) its bytes set aside while another result of its call was placed.
  CardBlock* taken = nullptr;
  uint64_t changes = 0;
  uint64_t index = 0;
  std::vector<char> aside;
};

// A provisional block set aside whose address the card handed on while another result of its call
// was placed (provisional_blocks.cpp): no address is its own any more, so it is in no table; the
// thread of its operator call, which alone commits or frees it, holds it by the pointer its storage
// still holds.
struct DisplacedBlock {
  const void* ptr;
  ProvisionalBlock* block;
};

}  // namespace supa
