// The out-of-memory errors of an emulated card and of the host behind it, worded as the real stack
// words them (torch.OutOfMemoryError either way, so code that recovers from OOM keeps working).
#pragma once

#include "card_memory.h"

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace supa {

// A size as the messages give it ("40.00 MiB").
std::string format_size(uint64_t size);
// The card has no room for a block of `size` bytes, with `allocated` bytes allocated on it.
[[noreturn]] void throw_card_oom(const CardMemory& card, c10::DeviceIndex device, size_t size, int64_t allocated);
// The host could not back a block the card had room for (`error`: errno).
[[noreturn]] void throw_host_oom(const CardMemory& card, c10::DeviceIndex device, size_t size, int error);

}  // namespace supa
