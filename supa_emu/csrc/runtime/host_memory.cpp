// The host memory behind the emulated card's memory (see host_memory.h).
#include "host_memory.h"

#include "card_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

namespace supa {

namespace {

bool lazily_backed(size_t size, Backing backing) {
  return backing == Backing::kReservedAddressSpace && size >= kReservedBackingMin;
}

}  // namespace

uintptr_t host_page_size() {
  static const auto size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return size;
}

void* back(size_t size, Backing backing) {
  if (lazily_backed(size, backing)) {
    // MAP_NORESERVE: not counted against the host's commit limit, so a card larger than the host
    // can be planned; pages cost host RAM only once written.
    void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return ptr == MAP_FAILED ? nullptr : ptr;
  }
  void* ptr = nullptr;
  if (const int error = posix_memalign(&ptr, kSegmentAlignment, size); error != 0) {
    errno = error;
    return nullptr;
  }
  return ptr;
}

void unback(void* ptr, size_t size, Backing backing) {
  if (lazily_backed(size, backing)) {
    munmap(ptr, size);
  } else {
    std::free(ptr);
  }
}

// PROT_NONE and MAP_NORESERVE: the range costs neither host RAM nor commit charge, however large
// (an expandable segment spans more than the card's capacity, as CUDA's address reservation does).
void* reserve_address_range(size_t size) {
  void* ptr = mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return ptr == MAP_FAILED ? nullptr : ptr;
}

void release_address_range(void* ptr, size_t size) {
  munmap(ptr, size);
}

bool map_range(void* ptr, size_t size) {
  return mprotect(ptr, size, PROT_READ | PROT_WRITE) == 0;
}

// The pages go back to the host (a later mapping reads zeros, as fresh pages do); a stray access
// to the range faults (SIGSEGV), where a card reports an illegal memory access.
void unmap_range(void* ptr, size_t size) {
  madvise(ptr, size, MADV_DONTNEED);
  mprotect(ptr, size, PROT_NONE);
}

}  // namespace supa
