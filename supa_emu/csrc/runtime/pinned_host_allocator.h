// Pinned host memory: host memory the runtime knows as pinned (`tensor.pin_memory()`).
#pragma once

#include <c10/core/Allocator.h>

namespace supa {

c10::Allocator* host_allocator();
bool is_pinned_ptr(const void* ptr);

}  // namespace supa
