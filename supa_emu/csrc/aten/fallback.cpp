// The boxed fallback: every operator without a supa kernel of its own runs PyTorch's CPU
// kernel on CPU views of the supa operands. Nothing is copied: inputs are viewed in place,
// and results that the CPU kernel allocates come from the device's memory pool (see
// DeviceOutputScope), so they become supa tensors by relabelling their memory.
//
// It also enforces the placement rules of a GPU: all supa operands on one device, CPU
// tensors only as 0-dim scalars (or as indices, which CUDA accepts too).
#include "../runtime/runtime.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>
#include <unordered_map>

namespace supa {
namespace {

const c10::DispatchKeySet kCpuKeys{c10::DispatchKey::CPU};

bool accepts_host_indices(const c10::OperatorName& name, const std::string& argument) {
  return argument == "indices" &&
         (name.name == "aten::index" || name.name == "aten::index_put_" || name.name == "aten::index_put" ||
          name.name == "aten::_index_put_impl_");
}

std::string device_name(const c10::Device& d) {
  return d.str();
}

struct HostOperand {
  at::Tensor original;  // the supa tensor the caller passed
  at::Tensor host;      // the CPU view given to the kernel
  c10::Storage host_storage;
  bool written;
};

class FallbackCall {
 public:
  FallbackCall(const c10::OperatorHandle& op, torch::jit::Stack* stack) : op_(op), stack_(*stack) {}

  void run() {
    const auto& schema = op_.schema();
    const size_t num_args = schema.arguments().size();
    const size_t first = stack_.size() - num_args;
    if (is_capturing()) {
      recorded_inputs_.assign(stack_.begin() + first, stack_.end());
    }
    std::vector<size_t> missing_generators;
    for (size_t i = 0; i < num_args; ++i) {
      const auto& arg = schema.arguments()[i];
      c10::IValue& value = stack_[first + i];
      const bool written = arg.alias_info() != nullptr && arg.alias_info()->isWrite();
      if (value.isTensor()) {
        value = to_host(value.toTensor(), written, arg.name());
      } else if (value.isTensorList()) {
        auto list = value.toTensorList();
        for (size_t j = 0; j < list.size(); ++j) {
          list.set(j, to_host(list.get(j), written, arg.name()));
        }
      } else if (value.isList()) {
        auto list = value.toList();
        for (size_t j = 0; j < list.size(); ++j) {
          c10::IValue item = list.get(j);
          if (item.isTensor()) {
            list.set(j, to_host(item.toTensor(), written, arg.name()));
          }
        }
      } else if (value.isDevice() && value.toDevice().type() == kSupa) {
        note_device(value.toDevice(), arg.name());
        value = c10::IValue(c10::Device(c10::DeviceType::CPU));
      } else if (value.isGenerator()) {
        value = c10::IValue(host_generator_of(value.toGenerator()));
      } else if (value.isNone() && arg.type()->kind() == c10::TypeKind::OptionalType &&
                 arg.type()->castRaw<c10::OptionalType>()->getElementType()->kind() ==
                     c10::TypeKind::GeneratorType) {
        missing_generators.push_back(first + i);
      }
    }
    if (device_ < 0) {
      device_ = current_device();
    }
    TORCH_CHECK(host_tensor_arg_.empty(), "Expected all tensors to be on the same device, but found at least two ",
                "devices, ", device_name(c10::Device(kSupa, device_)), " and cpu! (argument '", host_tensor_arg_,
                "' of ", schema.operator_name(), ")");
    for (size_t position : missing_generators) {
      // Sample from this device's generator, as a GPU kernel would, not the CPU default one.
      stack_[position] = c10::IValue(host_generator_of(default_generator(device_)));
    }
    {
      c10::DeviceGuard guard(c10::Device(kSupa, device_));
      DeviceOutputScope route_outputs(device_);
      op_.redispatchBoxed(kCpuKeys, &stack_);
      sync_written_operands();
    }
    const size_t num_returns = schema.returns().size();
    const size_t first_return = stack_.size() - num_returns;
    count_result_storages(first_return);
    for (size_t i = first_return; i < stack_.size(); ++i) {
      stack_[i] = to_device(stack_[i]);
    }
    if (is_capturing()) {
      record_call(op_, recorded_inputs_, std::vector<c10::IValue>(stack_.begin() + first_return, stack_.end()));
    }
  }

 private:
  void note_device(const c10::Device& device, const std::string& argument) {
    const c10::DeviceIndex index = device.has_index() ? device.index() : current_device();
    if (device_ < 0) {
      device_ = index;
      return;
    }
    TORCH_CHECK(index == device_, "Expected all tensors to be on the same device, but found at least two devices, ",
                device_name(c10::Device(kSupa, device_)), " and ", device_name(c10::Device(kSupa, index)),
                "! (argument '", argument, "' of ", op_.schema().operator_name(), ")");
  }

  at::Tensor to_host(const at::Tensor& t, bool written, const std::string& argument) {
    if (!t.defined()) {
      return t;
    }
    const c10::DeviceType type = t.device().type();
    if (type == c10::DeviceType::CPU) {
      if (t.dim() != 0 && !accepts_host_indices(op_.schema().operator_name(), argument) &&
          host_tensor_arg_.empty()) {
        host_tensor_arg_ = argument;
      }
      return t;
    }
    TORCH_CHECK(type == kSupa, "Expected all tensors to be on the same device, but found at least two devices, supa",
                " and ", t.device(), "! (argument '", argument, "' of ", op_.schema().operator_name(), ")");
    note_device(t.device(), argument);
    c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
    auto it = host_storages_.find(key);
    if (it == host_storages_.end()) {
      // Views of one storage share one host storage, so the kernel sees them as aliases.
      it = host_storages_.emplace(key, host_alias_storage(t.storage())).first;
    }
    at::Tensor host = tensor_over(it->second, kCpuKeys, t);
    operands_.push_back({t, host, it->second, written});
    return host;
  }

  // In-place kernels may restride their output or (for out= and resize_) give the host
  // storage new memory; carry both back to the supa tensor.
  void sync_written_operands() {
    for (auto& operand : operands_) {
      if (!operand.written) {
        continue;
      }
      c10::StorageImpl* device_storage = operand.original.storage().unsafeGetStorageImpl();
      c10::StorageImpl* host_storage = operand.host_storage.unsafeGetStorageImpl();
      if (host_storage->data() != device_storage->data() || host_storage->nbytes() != device_storage->nbytes()) {
        const size_t nbytes = host_storage->nbytes();
        c10::DataPtr data = take_device_block(host_storage, device_);
        if (!data && nbytes > 0) {
          data = device_allocator()->allocate(nbytes);
          std::memcpy(data.get(), host_storage->data(), nbytes);
        }
        device_storage->set_data_ptr_noswap(data ? std::move(data) : c10::DataPtr(nullptr, c10::Device(kSupa, device_)));
        device_storage->set_nbytes(nbytes);
      }
      c10::TensorImpl* dst = operand.original.unsafeGetTensorImpl();
      const at::Tensor& src = operand.host;
      if (dst->sizes() != src.sizes() || dst->strides() != src.strides() ||
          dst->storage_offset() != src.storage_offset()) {
        dst->set_sizes_and_strides(src.sizes(), src.strides(), src.storage_offset());
      }
    }
  }

  void count_result_storages(size_t first_return) {
    for (size_t i = first_return; i < stack_.size(); ++i) {
      if (stack_[i].isTensor()) {
        count_storage(stack_[i].toTensor());
      } else if (stack_[i].isTensorList()) {
        for (const at::Tensor& t : stack_[i].toTensorList().vec()) {
          count_storage(t);
        }
      }
    }
  }

  void count_storage(const at::Tensor& t) {
    if (t.defined() && t.has_storage()) {
      result_holders_[t.storage().unsafeGetStorageImpl()]++;
    }
  }

  c10::IValue to_device(const c10::IValue& value) {
    if (value.isTensor()) {
      return c10::IValue(tensor_to_device(value.toTensor()));
    }
    if (value.isTensorList()) {
      auto list = value.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        list.set(j, tensor_to_device(list.get(j)));
      }
      return c10::IValue(list);
    }
    return value;
  }

  at::Tensor tensor_to_device(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != c10::DeviceType::CPU) {
      return t;
    }
    for (const auto& operand : operands_) {
      if (operand.host.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
        return operand.original;  // in-place ops return their operand itself
      }
    }
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    for (const auto& operand : operands_) {
      if (operand.host_storage.unsafeGetStorageImpl() == storage) {
        return device_tensor_on(operand.original.storage(), t);  // a view of an operand
      }
    }
    auto adopted = adopted_.find(storage);
    if (adopted != adopted_.end()) {
      return device_tensor_on(adopted->second, t);
    }
    at::Tensor result = adopt_host_result(t, device_, result_holders_[storage]);
    adopted_.emplace(storage, result.storage());
    return result;
  }

  const c10::OperatorHandle& op_;
  torch::jit::Stack& stack_;
  c10::DeviceIndex device_ = -1;
  std::string host_tensor_arg_;
  std::vector<HostOperand> operands_;
  std::unordered_map<c10::StorageImpl*, c10::Storage> host_storages_;
  std::unordered_map<c10::StorageImpl*, size_t> result_holders_;
  std::unordered_map<c10::StorageImpl*, c10::Storage> adopted_;
  std::vector<c10::IValue> recorded_inputs_;
};

void supa_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  FallbackCall(op, stack).run();
}

}  // namespace

void route_composite_ops_to_cpu_kernels() {
  // Operators with a CPU kernel and a composite one would reach supa through the composite:
  // for structured ops a generated wrapper that allocates the result and calls `out=`, for a
  // few others (native_layer_norm, native_group_norm, ...) a decomposition that rounds
  // differently from the CPU kernel. Registering the fallback as their supa kernel runs the
  // CPU kernel itself: bit-identical to CPU, one call, no temporaries.
  static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (!op.has_value() || name.name.rfind("aten::", 0) != 0 ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !(op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
          op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd))) {
      continue;
    }
    const std::string qualified = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    library.impl(qualified.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&supa_fallback>());
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&supa_fallback>());
}

}  // namespace supa
