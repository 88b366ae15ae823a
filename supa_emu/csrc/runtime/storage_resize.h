// Resizing a supa storage (`storage().resize_()`, resize_ growing a tensor): a fresh block from the
// caching allocator, the common prefix of the bytes copied over, the old block freed.
#pragma once

#include <c10/core/StorageImpl.h>

#include <cstddef>

namespace supa {

void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes);

}  // namespace supa
