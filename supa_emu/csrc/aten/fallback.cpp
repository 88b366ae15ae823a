// The boxed fallback: every operator without a supa kernel of its own runs PyTorch's CPU
// kernel on CPU views of the supa operands. Nothing is copied: inputs are viewed in place,
// and what the CPU kernel allocates comes from the device's memory pool (see
// DeviceOutputScope), provisionally: the results become supa tensors by moving their bytes
// onto the card, counted as the card's in the order the operator returns them, while the
// kernel's own scratch never reaches the card's figures (a card kernel has none of it; what card
// kernels do keep, BLAS workspaces and attention's buffers, is modelled by their operators).
//
// In the planner's shapes mode (shape_only.h) the same call runs the operator's shape rule on
// meta tensors standing for the operands instead of its kernel, and allocates the results it
// describes on the card in the same order: the card's figures are those of the kernel's run.
//
// Sparse operands (COO and compressed layouts) cross the same way: CPU sparse tensors over
// host views of their index and value tensors.
//
// It also enforces the placement rules of a GPU: all supa operands on one device, CPU
// tensors only as 0-dim scalars (or as indices, which CUDA accepts too).
#include "fallback.h"
#include "fallback_call.h"
#include "shape_only.h"

#include "../runtime/caching_allocator.h"
#include "../runtime/device_guard.h"
#include "../runtime/devices.h"
#include "../runtime/generator.h"
#include "../runtime/graph.h"
#include "../runtime/host_alias.h"
#include "../runtime/host_routing_allocator.h"
#include "../runtime/stream_timeline.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string_view>
#include <vector>

namespace supa {
namespace {

bool accepts_host_indices(const c10::OperatorName& name, const std::string& argument) {
  return argument == "indices" &&
         (name.name == "aten::index" || name.name == "aten::index_put_" || name.name == "aten::index_put" ||
          name.name == "aten::_index_put_impl_");
}

// A copy's source may live on another card (CUDA's copy_ reads across devices; comm.broadcast of a
// sparse tensor copies into one made on each card).
// Asked for every operand of every call: string_view compares the lengths first (std::string's
// compare with a C string measures the literal at run time).
bool reads_from_any_card(const c10::OperatorName& name, const std::string& argument) {
  return std::string_view(argument) == "src" &&
         (std::string_view(name.name) == "aten::copy_" || std::string_view(name.name) == "aten::copy_sparse_to_sparse_");
}

std::string device_name(const c10::Device& d) {
  return d.str();
}

bool is_layout(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::OptionalType) {
    return is_layout(type->castRaw<c10::OptionalType>()->getElementType());
  }
  return type->kind() == c10::TypeKind::LayoutType;
}

struct HostOperand {
  at::Tensor original;  // the supa tensor the caller passed
  at::Tensor host;      // the CPU view given to the kernel
  c10::Storage host_storage;
  bool written;
};

class FallbackCall {
 public:
  // `shape_rule`: the operator's shape rule runs on meta tensors instead of the kernel.
  FallbackCall(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel, bool shape_rule = false)
      : op_(op), stack_(*stack), kernel_(kernel), shape_rule_(shape_rule) {}

  // `probe`: only the shape rule runs (it raises where it cannot tell the results); nothing is
  // allocated and the stack is left as the rule left it.
  void run(bool probe = false) {
    const auto& schema = op_.schema();
    const size_t num_args = schema.arguments().size();
    const size_t first = stack_.size() - num_args;
    if (is_capturing()) {
      recorded_inputs_ = with_own_lists(torch::jit::last(stack_, num_args));  // before run() converts its lists
    }
    c10::SmallVector<size_t, 1> generators;  // positions of Generator? arguments
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
        // A device option says where the results go (empty_like(x, device=), _to_copy): as on CUDA,
        // it need not be the operands' card.
        const c10::Device requested = value.toDevice();
        requested_device_ = requested.has_index() ? requested.index() : current_device();
        requested_argument_ = arg.name();
        value = c10::IValue(c10::Device(kernel_device_type()));
      } else if (value.isInt() && value.toInt() != static_cast<int64_t>(c10::kStrided) && is_layout(arg.real_type())) {
        full_dispatch_ = true;  // a factory asked for a sparse result
      } else if (value.isGenerator() ||
                 (value.isNone() && arg.type()->kind() == c10::TypeKind::OptionalType &&
                  arg.type()->castRaw<c10::OptionalType>()->getElementType()->kind() ==
                      c10::TypeKind::GeneratorType)) {
        generators.push_back(first + i);
      }
    }
    if (requested_device_ >= 0) {
      const bool writes = std::any_of(operands_.begin(), operands_.end(), [](const auto& o) { return o.written; }) ||
                          std::any_of(sparse_operands_.begin(), sparse_operands_.end(),
                                      [](const auto& o) { return o.written; });
      if (writes) {
        note_device(c10::Device(kSupa, requested_device_), requested_argument_);  // results are its operands
      } else {
        device_ = requested_device_;
      }
    }
    if (device_ < 0) {
      device_ = current_device();
    }
    TORCH_CHECK(host_tensor_arg_.empty(), "Expected all tensors to be on the same device, but found at least two ",
                "devices, ", device_name(c10::Device(kSupa, device_)), " and cpu! (argument '", host_tensor_arg_,
                "' of ", schema.operator_name(), ")");
    if (kernel_ == nullptr && !shape_rule_) {
      for (size_t position : generators) {
        // A random op without a supa kernel (random_ops.cpp has the card's): its CPU kernel draws
        // from a CPU generator seeded from counters of this device's generator (or the one given),
        // so its numbers too depend only on (seed, offset), and the offset moves on.
        const c10::IValue& given = stack_[position];
        stack_[position] = c10::IValue(host_generator_for_call(
            given.isNone() ? std::nullopt : std::optional<at::Generator>(given.toGenerator()), device_,
            largest_operand_numel_));
      }
    }
    if (shape_rule_) {
      TORCH_INTERNAL_ASSERT(!full_dispatch_, "supa_emu: sparse operands take their kernel in shapes mode");
      op_.redispatchBoxed(kMetaKeys, &stack_);
      if (probe) {
        return;
      }
      sync_written_operands();
    } else {
      CurrentDeviceScope guard(device_);
      DeviceOutputScope route_outputs(device_, /*take_from_card=*/kernel_ == nullptr && !full_dispatch_);
      if (kernel_ != nullptr) {
        kernel_(op_, &stack_);
      } else if (full_dispatch_) {
        op_.callBoxed(&stack_);  // the sparse CPU kernels: let the operands' layouts choose
      } else {
        op_.redispatchBoxed(kCpuKeys, &stack_);
      }
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
    if (shapes_mode()) {
      note_written_values(first_return);
    }
  }

 private:
  // Shapes mode: what the call wrote holds values only where its kernel ran on operands that hold them.
  void note_written_values(size_t first_return) {
    bool unknown = shape_rule_;
    for (const auto& operand : operands_) {
      unknown = unknown || values_unknown(operand.original);
    }
    for (const auto& operand : operands_) {
      if (operand.written) {
        note_values(operand.original, unknown);
      }
    }
    for (size_t i = first_return; i < stack_.size(); ++i) {
      if (stack_[i].isTensor()) {
        note_values(stack_[i].toTensor(), unknown);
      } else if (stack_[i].isTensorList()) {
        for (const at::Tensor& t : stack_[i].toTensorList().vec()) {
          note_values(t, unknown);
        }
      }
    }
  }

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

  c10::DeviceType kernel_device_type() const {
    return shape_rule_ ? c10::DeviceType::Meta : c10::DeviceType::CPU;
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
      // A shape rule takes host scalars as they are, and host indices as meta tensors.
      return shape_rule_ && t.dim() != 0 ? tensor_over(meta_storage(t.storage().nbytes()), kMetaKeys, t) : t;
    }
    TORCH_CHECK(type == kSupa, "Expected all tensors to be on the same device, but found at least two devices, supa",
                " and ", t.device(), "! (argument '", argument, "' of ", op_.schema().operator_name(), ")");
    if (!reads_from_any_card(op_.schema().operator_name(), argument)) {
      note_device(t.device(), argument);
    }
    largest_operand_numel_ = std::max(largest_operand_numel_, static_cast<uint64_t>(t.numel()));
    if (t.layout() != c10::kStrided) {
      // Sparse: a CPU sparse tensor over host views of its index and value tensors.
      at::Tensor host = sparse_over(t, c10::Device(c10::DeviceType::CPU),
                                    [&](const at::Tensor& part) { return to_host(part, written, argument); });
      sparse_operands_.push_back({t, host, c10::Storage(), written});
      full_dispatch_ = true;
      return host;
    }
    // Views of one storage share one host storage, so the kernel sees them as aliases.
    // Operators have a handful of operands: a linear search beats a hash map here.
    c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
    c10::Storage host_storage;
    for (const auto& operand : operands_) {
      if (operand.original.storage().unsafeGetStorageImpl() == key) {
        host_storage = operand.host_storage;
        break;
      }
    }
    if (!host_storage) {
      host_storage = shape_rule_ ? meta_storage(t.storage().nbytes()) : host_alias_storage(t.storage());
    }
    at::Tensor host = tensor_over(host_storage, shape_rule_ ? kMetaKeys : kCpuKeys, t);
    operands_.push_back({t, host, std::move(host_storage), written});
    return host;
  }

  // In-place kernels may restride their output or (for out= and resize_) give the host
  // storage new memory; carry both back to the supa tensor.
  void sync_written_operands() {
    for (auto& operand : sparse_operands_) {
      if (operand.written) {
        // Index and value tensors may have been replaced: point the supa tensor at the new ones.
        at::Tensor updated = sparse_over(operand.host, operand.original.device(),
                                         [&](const at::Tensor& part) { return tensor_to_device(part); });
        operand.original.unsafeGetTensorImpl()->shallow_copy_from(updated.getIntrusivePtr());
      }
    }
    for (auto& operand : operands_) {
      if (!operand.written) {
        continue;
      }
      c10::StorageImpl* device_storage = operand.original.storage().unsafeGetStorageImpl();
      c10::StorageImpl* host_storage = operand.host_storage.unsafeGetStorageImpl();
      if (shape_rule_) {
        if (host_storage->nbytes() != device_storage->nbytes()) {
          resize_card_storage(device_storage, host_storage->nbytes(), device_);
        }
      } else if (host_storage->data() != device_storage->data() || host_storage->nbytes() != device_storage->nbytes()) {
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
      c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
      for (auto& [known, count] : result_holders_) {
        if (known == storage) {
          ++count;
          return;
        }
      }
      result_holders_.emplace_back(storage, 1);
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
    if (!t.defined() || t.device().type() != kernel_device_type()) {
      return t;
    }
    if (t.layout() != c10::kStrided) {
      for (const auto& operand : sparse_operands_) {
        if (operand.host.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) {
          return operand.original;
        }
      }
      return sparse_over(t, c10::Device(kSupa, device_), [this](const at::Tensor& part) { return tensor_to_device(part); });
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
    for (const auto& [host, device_storage] : adopted_) {
      if (host == storage) {
        return device_tensor_on(device_storage, t);
      }
    }
    size_t holders = 0;
    for (const auto& [known, count] : result_holders_) {
      if (known == storage) {
        holders = count;
      }
    }
    at::Tensor result = shape_rule_ ? card_result(t, device_) : adopt_host_result(t, device_, holders);
    adopted_.emplace_back(storage, result.storage());
    return result;
  }

  const c10::OperatorHandle& op_;
  torch::jit::Stack& stack_;
  HostKernel kernel_;  // runs on the host operands; nullptr: the op's own CPU kernel
  bool shape_rule_;    // the op's shape rule on meta operands instead of a kernel (shapes mode)
  c10::DeviceIndex device_ = -1;
  c10::DeviceIndex requested_device_ = -1;  // a Device argument's card, where results go
  std::string requested_argument_;
  std::string host_tensor_arg_;
  // Small inline buffers: a typical call then allocates nothing for its bookkeeping.
  c10::SmallVector<HostOperand, 4> operands_;
  std::vector<HostOperand> sparse_operands_;  // their index/value tensors are in operands_
  bool full_dispatch_ = false;  // sparse operands or results: the CPU dispatch picks the kernel
  uint64_t largest_operand_numel_ = 1;  // the counters a CPU random kernel's call reserves
  c10::SmallVector<std::pair<c10::StorageImpl*, size_t>, 2> result_holders_;
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 2> adopted_;
  std::vector<c10::IValue> recorded_inputs_;
};

}  // namespace

void run_fallback_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, HostKernel kernel, bool shape_rule,
                       bool probe) {
  FallbackCall(op, stack, kernel, shape_rule).run(probe);
}

void route_composite_ops_to_cpu_kernels() {
  // Operators with a CPU kernel and a composite one would reach supa through the composite:
  // for structured ops a generated wrapper that allocates the result and calls `out=`, for a
  // few others (native_layer_norm, native_group_norm, ...) a decomposition that rounds
  // differently from the CPU kernel. Registering the fallback as their supa kernel runs the
  // CPU kernel itself: bit-identical to CPU, one call, no temporaries.
  // For sparse layouts the composite kernels are mostly the "not a sparse tensor" errors
  // (is_coalesced, ...), so every op with a sparse CPU kernel gets the fallback.
  struct Route {
    c10::DispatchKey cpu;
    c10::DispatchKey supa;
    bool only_over_composites;
  };
  static torch::Library dense(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  static torch::Library coo(torch::Library::IMPL, "aten", c10::DispatchKey::SparsePrivateUse1, __FILE__, __LINE__);
  static torch::Library compressed(torch::Library::IMPL, "aten", c10::DispatchKey::SparseCsrPrivateUse1, __FILE__,
                                   __LINE__);
  const std::pair<Route, torch::Library*> routes[] = {
      {{c10::DispatchKey::CPU, c10::DispatchKey::PrivateUse1, true}, &dense},
      {{c10::DispatchKey::SparseCPU, c10::DispatchKey::SparsePrivateUse1, false}, &coo},
      {{c10::DispatchKey::SparseCsrCPU, c10::DispatchKey::SparseCsrPrivateUse1, false}, &compressed},
  };
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (!op.has_value() || name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    const bool has_composite = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
                               op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd);
    const std::string qualified = name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
    for (const auto& [route, library] : routes) {
      if (op->hasKernelForDispatchKey(route.cpu) && !op->hasKernelForDispatchKey(route.supa) &&
          (has_composite || !route.only_over_composites)) {
        library->impl(qualified.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&run_cpu_kernel>());
      }
    }
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_cpu_kernel>());
}

TORCH_LIBRARY_IMPL(_, SparsePrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_cpu_kernel>());
}

TORCH_LIBRARY_IMPL(_, SparseCsrPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_cpu_kernel>());
}

}  // namespace supa
