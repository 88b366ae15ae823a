#include "storage_resize.h"

#include "caching_allocator.h"
#include "devices.h"
#include "memcheck.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

namespace supa {

void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  const c10::DeviceIndex device = storage->device().index();
  c10::DataPtr fresh;
  if (nbytes == 0) {
    fresh = c10::DataPtr(nullptr, nullptr, &delete_device_ptr, c10::Device(kSupa, device));
  } else {
    void* ptr = allocate_block(nbytes, device);
    fresh = c10::DataPtr(ptr, ptr, &delete_device_ptr, c10::Device(kSupa, device));
    const size_t keep = std::min(nbytes, storage->nbytes());
    if (keep > 0 && storage->data() != nullptr) {
      std::memcpy(ptr, storage->data(), keep);
    }
    memcheck_resized(storage->data(), ptr, storage->data() != nullptr ? keep : 0, nbytes);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

}  // namespace supa
