// Tensors living on both sides: CPU views of device memory, and device tensors over memory
// that CPU kernels produced.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/Storage.h>

#include <cstddef>
#include <cstdint>
#include <functional>

namespace supa {

// A CPU tensor over a supa tensor's memory: same sizes, strides and offset, no copy.
at::Tensor host_view(const at::Tensor& device_tensor);
// A flat CPU tensor over `numel` elements of contiguous `t`, from element `offset` (t's memory if
// t is a CPU tensor, its host alias if a supa tensor). Built directly: narrow() and view() go
// through the dispatcher and autograd's view tracking, which cost more than the rest of a
// collective's launch.
at::Tensor flat_host_slice(const at::Tensor& t, int64_t offset, int64_t numel);
// A supa tensor over `device_storage` with the geometry of `like`.
at::Tensor device_tensor_on(const c10::Storage& device_storage, const at::Tensor& like);
// Turns a CPU result into a supa tensor: takes over its memory when it came from the
// device pool (DeviceOutputScope), copies it otherwise.
// `holders` is how many references to its storage the caller knows of (the storage can be
// taken over only when nothing else holds it).
at::Tensor adopt_host_result(const at::Tensor& cpu, c10::DeviceIndex device, size_t holders = 1);
// A CPU storage over a supa storage's memory (zero copy). While it is alive it keeps the
// supa storage alive. It is resizable: a CPU kernel that grows it gets fresh memory, which
// the operator fallback then moves back into the supa storage.
c10::Storage host_alias_storage(const c10::Storage& device_storage);
at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like);
// The same with its own geometry (dtype, conjugation and negation still `like`'s).
at::Tensor tensor_over(const c10::Storage& storage, c10::DispatchKeySet keys, const at::Tensor& like,
                       c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t storage_offset);
// A sparse (COO or compressed) tensor like `sparse` on `device` (CPU or supa), whose index
// and value tensors are `convert` applied to those of `sparse`: how sparse operands and
// results cross between the two sides without copies.
at::Tensor sparse_over(const at::Tensor& sparse, c10::Device device,
                       const std::function<at::Tensor(const at::Tensor&)>& convert);

}  // namespace supa
