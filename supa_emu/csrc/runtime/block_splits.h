// How the card's free blocks are split to serve requests and merged back when freed (the rules are
// card_memory.h's; the members, CardMemory's, are declared there and defined in block_splits.cpp).
//
// A small operator's result is split off the front of its segment's free block and merged back
// into it on every call. Done literally (the free block out of its list, the remainder into it, and
// back again) that costs the result most of its placing, so where the free lists' order allows, the
// free block's list entry stays in place and is changed to the remainder, and a freed block merges
// into its one free neighbour's entry; the blocks, their order and every figure are the same.
#pragma once

#include "card_memory.h"
