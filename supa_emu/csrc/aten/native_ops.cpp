// Operators the supa device implements itself: allocation, metadata (views, resize, set_)
// and copies between devices. Everything else goes through the fallback.
#include "../runtime/caching_allocator.h"
#include "../runtime/device_guard.h"
#include "../runtime/devices.h"
#include "../runtime/graph.h"
#include "../runtime/host_alias.h"
#include "../runtime/pinned_host_allocator.h"
#include "../runtime/storage_resize.h"
#include "../runtime/stream_timeline.h"
#include "shape_only.h"

#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/TensorUtils.h>
#include <ATen/native/Resize.h>
#include <ATen/native/TensorFactories.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <vector>

namespace supa {
namespace {

constexpr const char* kNoDouble = "SUPA device does not support double (float64). Please use float32 instead.";

c10::DeviceIndex target_index(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) {
    return device->index();
  }
  return current_device();
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> /*pin_memory*/,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::Layout::Strided, "supa tensors must be strided, got layout ",
              *layout);
  c10::DeviceGuard guard(c10::Device(kSupa, target_index(device)));
  return at::detail::empty_generic(size, device_allocator(), kSupaKeys,
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> /*pin_memory*/) {
  TORCH_CHECK(!layout.has_value() || *layout == c10::Layout::Strided, "supa tensors must be strided, got layout ",
              *layout);
  c10::DeviceGuard guard(c10::Device(kSupa, target_index(device)));
  return at::detail::empty_strided_generic(size, stride, device_allocator(), kSupaKeys,
                                           c10::dtype_or_default(dtype));
}

// Autograd's all-zero gradients (sgn, ...): a tensor without memory, marked ZeroTensor, as on CUDA.
at::Tensor efficient_zero_tensor(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                                 std::optional<c10::Layout> /*layout*/, std::optional<c10::Device> device,
                                 std::optional<bool> /*pin_memory*/) {
  const c10::DeviceIndex index = target_index(device);
  check_device_index(index);
  // Storages keep a pointer to their allocator: one per device, alive for the process.
  static const auto allocators = [] {
    std::vector<std::unique_ptr<at::native::ZeroTensorAllocator>> all;
    for (int i = 0; i < device_count(); ++i) {
      all.push_back(
          std::make_unique<at::native::ZeroTensorAllocator>(c10::Device(kSupa, static_cast<c10::DeviceIndex>(i))));
    }
    return all;
  }();
  const c10::DispatchKeySet keys = kSupaKeys | c10::DispatchKeySet(c10::DispatchKey::ZeroTensor);
  return at::detail::empty_generic(size, allocators.at(index).get(), keys, c10::dtype_or_default(dtype),
                                   std::nullopt);
}

// Overflow-checked: a view whose extent wraps around would get a storage far too small for it.
size_t bytes_needed(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset, size_t itemsize) {
  for (int64_t s : sizes) {
    if (s == 0) {
      return 0;
    }
  }
  int64_t last = offset;
  bool overflow = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    int64_t reach = 0;
    overflow |= __builtin_mul_overflow(sizes[i] - 1, strides[i], &reach);
    overflow |= __builtin_add_overflow(last, reach, &last);
  }
  int64_t bytes = 0;
  overflow |= __builtin_add_overflow(last, int64_t{1}, &last);
  overflow |= __builtin_mul_overflow(last, static_cast<int64_t>(itemsize), &bytes);
  TORCH_CHECK(!overflow && bytes >= 0, "Storage size calculation overflowed with sizes=", sizes, " and strides=",
              strides);
  return static_cast<size_t>(bytes);
}

void ensure_storage_fits(const at::Tensor& self) {
  const size_t needed =
      bytes_needed(self.sizes(), self.strides(), self.storage_offset(), self.dtype().itemsize());
  c10::StorageImpl* storage = self.storage().unsafeGetStorageImpl();
  if (needed > storage->nbytes()) {
    c10::DeviceGuard guard(self.device());
    if (card_bytes_move(storage->nbytes())) {
      resize_storage_bytes(storage, needed);
    } else {
      resize_card_storage(storage, needed, self.device().index());
      note_values(self, /*unknown=*/true);  // shapes mode: the bytes it held were not carried over
    }
  }
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (self.sizes() != size) {
    impl->set_sizes_contiguous(size);
  }
  if (memory_format.has_value() && *memory_format != c10::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  ensure_storage_fits(self);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kSupa, "Expected a supa storage for set_ on a supa tensor, got ",
              source.device());
  // As CUDA's set_: the storage stays on its card (a resize below allocates on the tensor's).
  TORCH_CHECK(source.device() == self.device(), "Attempted to set the storage of a tensor on device \"",
              self.device(), "\" to a storage on different device \"", source.device(),
              "\".  This is no longer allowed; the devices must match.");
  TORCH_CHECK(offset >= 0, "Tensor: invalid storage offset ", offset);
  for (int64_t s : size) {
    TORCH_CHECK(s >= 0, "Trying to create tensor with negative dimension ", s, ": ", size);
  }
  TORCH_CHECK(stride.empty() || stride.size() == size.size(), "unequal size length (", size.size(),
              ") and stride length (", stride.size(), ")");
  for (int64_t s : stride) {
    TORCH_CHECK(s >= 0, "set_: negative strides are not supported, got ", stride);
  }
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (impl->storage().unsafeGetStorageImpl() != source.unsafeGetStorageImpl()) {
    impl->set_storage_keep_dtype(std::move(source));
  }
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
    impl->set_storage_offset(offset);
  } else {
    impl->set_sizes_and_strides(size, stride, offset);
  }
  ensure_storage_fits(self);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.unsafeGetTensorImpl() == source.unsafeGetTensorImpl()) {
    return self;
  }
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage empty(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), 0,
                                                            device_allocator()->allocate(0), device_allocator(),
                                                            /*resizable=*/true));
  return set_storage(self, std::move(empty), 0, {0}, {});
}

at::Tensor host_side(const at::Tensor& t) {
  return t.device().type() == kSupa ? host_view(t) : t;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.device().type() == kSupa || self.device().is_cpu(), "supa cannot copy from ", self.device());
  TORCH_CHECK(dst.device().type() == kSupa || dst.device().is_cpu(), "supa cannot copy to ", dst.device());
  at::Tensor src = host_side(self);
  if (dst.device().type() == kSupa && dst.scalar_type() == at::kDouble && self.device().is_cpu()) {
    // Real SUPA cards have no float64: the copy kernel refuses it unless demotion is on.
    TORCH_CHECK(dtype_demotion_enabled(), kNoDouble);
    TORCH_WARN_ONCE(kNoDouble);
    src = src.to(at::kFloat);
  }
  if (is_capturing() && !is_replaying()) {
    // Captured as a copy node: it moves the bytes at each replay, not now. A card's driver refuses
    // to capture a copy to or from pageable host memory.
    for (const at::Tensor* t : {&self, &dst}) {
      // Refused before anything reaches the stream, so the capture itself stays valid.
      TORCH_CHECK(!t->device().is_cpu() || t->numel() == 0 || t->is_pinned(),
                  "Cannot copy between CPU and SUPA tensors during SUPA graph capture unless the CPU tensor is "
                  "pinned.");
    }
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("aten::_copy_from", "");
    record_call(op, {self, dst, non_blocking}, {dst});
    return dst;
  }
  const bool card_to_card = self.device().type() == kSupa && dst.device().type() == kSupa;
  const bool moved = !card_to_card || card_bytes_move(dst.numel() * dst.dtype().itemsize());
  if (dst.numel() > 0 && moved) {
    host_side(dst).copy_(src);
  }
  if (shapes_mode()) {
    note_values(dst, !moved || values_unknown(self));
  }
  if (!non_blocking && !card_to_card) {
    // A blocking copy to or from the host returns once the stream has run it, as on a card.
    const c10::DeviceIndex device = (self.device().is_cpu() ? dst : self).device().index();
    wait_until_ns(stream_ready_ns(device, current_stream_id(device)));
  }
  if (non_blocking && !card_to_card) {
    const at::Tensor& host = self.device().is_cpu() ? self : dst;
    const c10::DeviceIndex device = (self.device().is_cpu() ? dst : self).device().index();
    if (host.numel() > 0 && host.is_pinned()) {
      record_pinned_use(host, c10::Stream(c10::Stream::UNSAFE, c10::Device(kSupa, device), current_stream_id(device)));
    }
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kSupa, "record_stream: expected a ", c10::DeviceTypeName(kSupa, true),
              " stream, got one of device type ", stream.device_type());
  device_allocator()->recordStream(self.storage().data_ptr(), stream);
}

bool is_dense_host_or_supa(c10::DispatchKeySet keys) {
  return keys.has(c10::DispatchKey::Dense) &&
         (keys.has_backend(c10::BackendComponent::CPUBit) || keys.has_backend(c10::BackendComponent::PrivateUse1Bit));
}

// Module.to() moves a parameter by swapping its `.data` when PyTorch says the two tensor
// types are shallow-copy compatible; otherwise it makes new Parameter objects and an
// optimizer built before the move holds stale ones. CUDA and CPU dense tensors are
// compatible; supa and CPU dense tensors must be too.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  if (is_dense_host_or_supa(self.key_set()) && is_dense_host_or_supa(from.key_set())) {
    return true;
  }
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, AutogradPrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_efficientzerotensor", efficient_zero_tensor);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("record_stream", record_stream);
}

// A lazily conjugated or negated operand would make the Conjugate/Negative fallbacks
// materialize it with clone(), whose copy_ calls _copy_from again: endless recursion, then a
// stack overflow. copy_from keeps both bits on its host views and the CPU copy resolves them,
// so _copy_from passes through those keys (only non-CPU, non-CUDA devices reach _copy_from).
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace supa
