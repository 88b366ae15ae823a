// Tensors that live on both sides: CPU views of device memory and device tensors over
// memory that CPU kernels produced. This is what lets every operator run on PyTorch's CPU
// kernels without copying its operands.
#include "runtime.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace supa {
namespace {

void release_device_storage(void* ctx) {
  delete static_cast<c10::Storage*>(ctx);
}

const c10::DispatchKeySet kSupaKeys{c10::DispatchKey::PrivateUse1};
const c10::DispatchKeySet kCpuKeys{c10::DispatchKey::CPU};

}  // namespace

c10::Storage host_alias_storage(const c10::Storage& device_storage) {
  void* data = const_cast<void*>(device_storage.data());
  c10::DataPtr ptr(data, new c10::Storage(device_storage), &release_device_storage,
                   c10::Device(c10::DeviceType::CPU));
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), device_storage.nbytes(), std::move(ptr), c10::GetCPUAllocator(),
      /*resizable=*/true));
}

at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), keys, like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  return out;
}

at::Tensor host_view(const at::Tensor& device_tensor) {
  TORCH_CHECK(device_tensor.device().type() == kSupa, "host_view expects a supa tensor, got ",
              device_tensor.device());
  return tensor_over(host_alias_storage(device_tensor.storage()), kCpuKeys, device_tensor);
}

at::Tensor device_tensor_on(const c10::Storage& device_storage, const at::Tensor& like) {
  return tensor_over(device_storage, kSupaKeys, like);
}

at::Tensor adopt_host_result(const at::Tensor& cpu, c10::DeviceIndex device, size_t holders) {
  c10::StorageImpl* host = cpu.storage().unsafeGetStorageImpl();
  const size_t nbytes = host->nbytes();
  c10::DataPtr data;
  if (c10::raw::intrusive_ptr::use_count(host) == holders) {
    data = take_device_block(host, device);
  }
  if (!data && nbytes > 0) {
    // Not from the device pool (or shared elsewhere): copy it into device memory.
    c10::DeviceGuard guard(c10::Device(kSupa, device));
    data = device_allocator()->allocate(nbytes);
    std::memcpy(data.get(), host->data(), nbytes);
  } else if (!data) {
    data = c10::DataPtr(nullptr, c10::Device(kSupa, device));
  }
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes, std::move(data), device_allocator(), /*resizable=*/true));
  return tensor_over(storage, kSupaKeys, cpu);
}

}  // namespace supa
