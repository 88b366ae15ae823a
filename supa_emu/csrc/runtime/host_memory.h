// The host memory behind the emulated card's memory: a segment's (from the heap, or in shapes
// mode from reserved address space that costs no host RAM until written), and an expandable
// segment's address range, reserved without memory, whose pages are mapped on demand.
#pragma once

#include <cstddef>
#include <cstdint>

namespace supa {

// Segments of at least this size are backed by reserved address space under kReservedAddressSpace
// (smaller ones share heap pages, which a process touches anyway).
constexpr size_t kReservedBackingMin = 64 << 10;

enum class Backing {
  kHeap,                 // every segment from the heap (posix_memalign): compute mode
  kReservedAddressSpace  // larger segments mapped without reserving host memory: shapes mode
};

// Host memory of `size` bytes as `backing` provides it for a segment of that size (nullptr with
// errno set when the host has none), and its release.
void* back(size_t size, Backing backing);
void unback(void* ptr, size_t size, Backing backing);

uintptr_t host_page_size();

// An address range of `size` bytes with nothing mapped (nullptr with errno set when the host has
// no address space left), and its release.
void* reserve_address_range(size_t size);
void release_address_range(void* ptr, size_t size);
// Makes [ptr, ptr + size) of a reserved range readable and writable (reading zeros; false with
// errno set when the host refuses), or gives its pages back and makes it inaccessible again.
bool map_range(void* ptr, size_t size);
void unmap_range(void* ptr, size_t size);

}  // namespace supa
