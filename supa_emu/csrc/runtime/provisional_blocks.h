// An operator kernel's allocations, counted by the card only once handed back as results (see
// provisional_blocks.cpp).
#pragma once

#include <c10/core/Device.h>

#include <cstddef>

namespace supa {

// An operator kernel's allocation on `device`: host memory that the card does not count until
// commit_block() (a result the operator hands back); freed before that (the kernel's own
// scratch) it leaves the card's statistics, history and cache as they were. Only the results of
// an operator thus reach the card's figures, placed in the order they are committed.
// `from_card`: the block the card would hand out now, if a free one fits (committed without a
// copy when placing its request then hands out the same block; see provisional_blocks.cpp);
// otherwise host memory.
void* allocate_provisional(size_t nbytes, c10::DeviceIndex device, bool from_card = false);
// The calling thread starts an operator call: its blocks taken from now on are that call's (those
// set aside when one of its results must be placed anew).
void begin_operator_allocations();
// Places a provisional block on the card as a request made now and returns the card's block: the
// block itself when it was taken from the card and the card has not changed since; otherwise a
// block its bytes move to, and the provisional memory goes back (the caller drops `ptr` without
// freeing it). A pointer that is not provisional comes back unchanged.
void* commit_block(void* ptr);

namespace allocator_state {
// For caching_allocator.cpp: a provisional block freed before its operator handed it back goes
// back where it came from (takes g_mutex; false for other blocks); the device of one, or -1
// (under g_mutex).
bool drop_provisional(void* ptr);
c10::DeviceIndex provisional_device(const void* ptr);
}  // namespace allocator_state

}  // namespace supa
