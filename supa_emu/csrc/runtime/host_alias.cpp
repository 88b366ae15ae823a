// Tensors that live on both sides: CPU views of device memory and device tensors over
// memory that CPU kernels produced. This is what lets every operator run on PyTorch's CPU
// kernels without copying its operands.
#include "host_alias.h"

#include "caching_allocator.h"
#include "devices.h"
#include "host_routing_allocator.h"
#include "replay_queue.h"

#include <ATen/SparseCsrTensorImpl.h>
#include <ATen/SparseTensorImpl.h>
#include <ATen/ops/_efficientzerotensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace supa {
namespace {

// The host alias's context is the device StorageImpl itself, holding one reference (no
// separate heap object: this runs once per operand of every fallback call).
void release_device_storage(void* ctx) {
  c10::intrusive_ptr<c10::StorageImpl>::reclaim(static_cast<c10::StorageImpl*>(ctx));
}

}  // namespace

c10::Storage host_alias_storage(const c10::Storage& device_storage) {
  run_queued_replays();  // the host is about to read or write card memory: launched work first
  void* data = const_cast<void*>(device_storage.data());
  auto keep = c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(device_storage.unsafeGetStorageImpl());
  c10::DataPtr ptr(data, keep.release(), &release_device_storage,
                   c10::Device(c10::DeviceType::CPU));
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), device_storage.nbytes(), std::move(ptr), c10::GetCPUAllocator(),
      /*resizable=*/true));
}

at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like,
                       c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t storage_offset) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), keys, like.dtype());
  c10::TensorImpl* impl = out.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  // Lazy conjugation and negation are part of what the memory means: keep them on both sides.
  impl->_set_conj(like.is_conj());
  impl->_set_neg(like.is_neg());
  return out;
}

at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like) {
  return tensor_over(storage, keys, like, like.sizes(), like.strides(), like.storage_offset());
}

at::Tensor host_view(const at::Tensor& device_tensor) {
  TORCH_CHECK(device_tensor.device().type() == kSupa, "host_view expects a supa tensor, got ",
              device_tensor.device());
  return tensor_over(host_alias_storage(device_tensor.storage()), kCpuKeys, device_tensor);
}

at::Tensor flat_host_slice(const at::Tensor& t, int64_t offset, int64_t numel) {
  TORCH_CHECK(t.is_contiguous() && offset >= 0 && numel >= 0 && offset + numel <= t.numel(),
              "flat_host_slice expects a contiguous tensor and a range within it");
  const c10::Storage storage = t.device().type() == kSupa ? host_alias_storage(t.storage()) : t.storage();
  const int64_t size[1] = {numel}, stride[1] = {1};
  return tensor_over(storage, kCpuKeys, t, size, stride, t.storage_offset() + offset);
}

at::Tensor device_tensor_on(const c10::Storage& device_storage, const at::Tensor& like) {
  return tensor_over(device_storage, kSupaKeys, like);
}

at::Tensor adopt_host_result(const at::Tensor& cpu, c10::DeviceIndex device, size_t holders) {
  if (cpu._is_zerotensor()) {
    // A zero tensor has no memory to take over or copy (autograd's zero gradients).
    return at::_efficientzerotensor(cpu.sizes(), cpu.options().device(c10::Device(kSupa, device)));
  }
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

at::Tensor sparse_over(const at::Tensor& sparse, c10::Device device,
                       const std::function<at::Tensor(const at::Tensor&)>& convert) {
  const bool cpu = device.is_cpu();
  if (sparse.layout() == c10::kSparse) {
    const auto* impl = static_cast<const at::SparseTensorImpl*>(sparse.unsafeGetTensorImpl());
    const at::Tensor indices = convert(impl->indices());
    const at::Tensor values = convert(impl->values());
    // The impl takes its device from a placeholder it allocates on the current device; it must
    // be the device of the index and value tensors, which need not be the current one.
    c10::OptionalDeviceGuard on_values_device;
    if (!cpu) {
      on_values_device.reset_device(values.device());
    }
    auto out = at::detail::make_tensor<at::SparseTensorImpl>(
        c10::DispatchKeySet(cpu ? c10::DispatchKey::SparseCPU : c10::DispatchKey::SparsePrivateUse1),
        sparse.dtype());
    auto* out_impl = static_cast<at::SparseTensorImpl*>(out.unsafeGetTensorImpl());
    out_impl->resize_(impl->sparse_dim(), impl->dense_dim(), sparse.sizes());
    out_impl->set_indices_and_values_unsafe(indices, values);
    out_impl->set_coalesced(impl->coalesced());
    return out;
  }
  TORCH_CHECK(sparse.layout() == c10::kSparseCsr || sparse.layout() == c10::kSparseCsc ||
                  sparse.layout() == c10::kSparseBsr || sparse.layout() == c10::kSparseBsc,
              "supa tensors can be strided, sparse COO or sparse compressed (CSR, CSC, BSR, BSC); got layout ",
              sparse.layout());
  const auto* impl = static_cast<const at::SparseCsrTensorImpl*>(sparse.unsafeGetTensorImpl());
  const at::Tensor compressed = convert(impl->compressed_indices());
  const at::Tensor plain = convert(impl->plain_indices());
  const at::Tensor values = convert(impl->values());
  auto out = at::detail::make_tensor<at::SparseCsrTensorImpl>(
      c10::DispatchKeySet(cpu ? c10::DispatchKey::SparseCsrCPU : c10::DispatchKey::SparseCsrPrivateUse1),
      values.device(), sparse.layout(), sparse.dtype());
  static_cast<at::SparseCsrTensorImpl*>(out.unsafeGetTensorImpl())
      ->set_member_tensors(compressed, plain, values, sparse.sizes());
  return out;
}

}  // namespace supa
