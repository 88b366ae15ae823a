// The out-of-memory messages (see out_of_memory.h).
#include "out_of_memory.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <sstream>

namespace supa {

std::string format_size(uint64_t size) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed;
  if (size <= 1024) {
    os << size << " bytes";
  } else if (size <= 1048576) {
    os << (static_cast<double>(size) / 1024.0) << " KiB";
  } else if (size <= 1073741824ULL) {
    os << (static_cast<double>(size) / 1048576.0) << " MiB";
  } else {
    os << (static_cast<double>(size) / 1073741824.0) << " GiB";
  }
  return os.str();
}

void throw_card_oom(const CardMemory& card, c10::DeviceIndex device, size_t size, int64_t allocated) {
  std::ostringstream msg;
  msg << "SUPA out of memory. Tried to allocate " << format_size(size) << ". GPU "
      << static_cast<int>(device) << " has a total capacity of " << format_size(card.capacity())
      << " of which " << format_size(card.unreserved()) << " is free. ";
  if (card.fraction() < 1.0) {
    msg << "This process is limited to " << format_size(card.limit())
        << " by set_per_process_memory_fraction. ";
  }
  msg << "Of the allocated memory " << format_size(allocated)
      << " is allocated by PyTorch, and " << format_size(card.reserved() - allocated)
      << " is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
         "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  "
         "See documentation for Memory Management  "
         "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)";
  TORCH_CHECK_WITH(OutOfMemoryError, false, msg.str());
}

// Said with the host's numbers, instead of a card OOM whose "free" figure would contradict it.
void throw_host_oom(const CardMemory& card, c10::DeviceIndex device, size_t size, int error) {
  std::ostringstream msg;
  msg << "SUPA emulator: the host could not provide " << format_size(size) << " of memory for an allocation on "
      << "supa:" << static_cast<int>(device) << " (" << std::strerror(error) << "). The emulated card has "
      << format_size(std::max<int64_t>(0, card.limit() - card.reserved()))
      << " of its capacity free, but its memory is this host's memory: lower SUPA_EMU_MEMORY to what the host can "
         "hold, or free host memory.";
  TORCH_CHECK_WITH(OutOfMemoryError, false, msg.str());
}

}  // namespace supa
