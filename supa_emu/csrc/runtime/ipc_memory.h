// Device memory shared with other processes (the emulator's CUDA IPC).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Storage.h>

#include <cstddef>

namespace supa {

struct SharedBlock {
  int fd;  // names the block to a receiver; owned by the storage (-1 for an empty one)
  size_t nbytes;
};
// Moves the storage's memory into a shared block (the first time) and counts one more
// pending reference, which the receiver takes over (or releases when it maps the block already).
SharedBlock export_storage(const c10::Storage& storage);
// Maps the block behind `fd` (not taken over) as a non-resizable storage on `device`.
c10::Storage import_storage(int fd, size_t nbytes, c10::DeviceIndex device);
void release_pending_reference(const c10::Storage& storage);
bool is_shared_storage(const c10::Storage& storage);
// Frees the blocks whose sender storage and receivers are all gone; returns how many.
size_t collect_shared_blocks();

}  // namespace supa
