// Pinned host memory: host memory the runtime knows as pinned (`tensor.pin_memory()`).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>

namespace supa {

c10::Allocator* host_allocator();
// Whether `ptr` lies in pinned host memory (a block's start or any address inside it).
bool is_pinned_ptr(const void* ptr);
// A non_blocking copy used pinned `host` memory on `stream`: once freed, its block serves no one
// until the stream has passed this point (a card's copy engine may still be reading it).
void record_pinned_use(const at::Tensor& host, c10::Stream stream);

}  // namespace supa
