// Expandable segments (allocator setting expandable_segments:True), as PyTorch's CUDA caching
// allocator has them (c10/cuda/CUDACachingAllocator.cpp, "Expandable Segments"):
// - New memory is not a segment per request: each pool (small, large; of the card's general pool,
//   a graph's or a MemPool's) has one segment per stream, an address range of 9/8 of the card's
//   capacity reserved with nothing behind it, and pages are mapped into it as requests need them:
//   2 MiB pages in the small pool, 20 MiB in the large one. Reserved memory is the mapped pages.
// - A request that no free block serves maps pages at the lowest address where free and unmapped
//   space together hold it (after the free block before an unmapped range, else a new segment);
//   the limit set_per_process_memory_fraction sets is checked against the request's usual segment
//   size, the card's capacity against the pages mapped.
// - Blocks inside the mapped pages are split and merged as usual; with the setting on, a block of
//   the large pool splits whenever 512 bytes would remain. Among free blocks that fit, best fit
//   prefers the block that could grow least (its size plus the unmapped space after it); with the
//   setting off, blocks of expandable segments serve no request. (A MemPool(no_split=True) keeps a
//   segment per block, expandable segments or not.)
// - empty_cache, and the release before an out-of-memory error, unmap the whole pages inside free
//   blocks; a segment with no page left mapped goes back. Garbage collection and the release of
//   oversize blocks leave expandable segments alone.
// - Statistics: a mapping counts in reserved_bytes and num_device_alloc (an unmapping in
//   num_device_free), never in the segment counts; inactive_split leaves their blocks out. The
//   memory history records segment_map / segment_unmap; a snapshot shows one segment per
//   contiguous mapped range, with is_expandable.
// The members of CardMemory that do this are in expandable_segments.cpp.
#pragma once

#include <cstddef>
#include <cstdint>

namespace supa {

// The page of an expandable segment of the small or large pool.
size_t expandable_page(bool small);
// The address range of an expandable segment on a card of `capacity` bytes.
size_t expandable_range(int64_t capacity, size_t page);

}  // namespace supa
