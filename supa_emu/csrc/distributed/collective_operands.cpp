// Host-side operands of the bccl backend's hot collectives, checked and built in one call.
//
// bccl's gloo transport hands gloo CPU views of supa tensors. For the common case (dense,
// contiguous supa tensors of one dtype on one device, with the element counts the collective
// needs) the checks and views cost a few microseconds here against tens in Python, where every
// collective call paid them. Anything else returns nothing, and Python takes its slow path, which raises the
// precise error or stages layouts gloo cannot address.
#include "collective_operands.h"

#include "../runtime/devices.h"
#include "../runtime/host_alias.h"

#include <cstring>

namespace supa {
namespace {

bool plain_device_tensor(const at::Tensor& t) {
  return t.defined() && t.device().type() == kSupa && t.layout() == c10::kStrided && t.is_contiguous();
}

at::Tensor flat_host_view(const at::Tensor& t) {
  return flat_host_slice(t, 0, t.numel());
}

}  // namespace

void copy_rows(at::Tensor& into, const at::Tensor& source) {
  TORCH_CHECK(into.device().is_cpu() && into.is_contiguous() && source.device().is_cpu() && source.is_contiguous() &&
                  into.scalar_type() == source.scalar_type() &&
                  (source.numel() == 0 ? into.numel() == 0 : into.numel() % source.numel() == 0),
              "copy_rows expects contiguous CPU tensors of one dtype, the first a whole number of copies of the second");
  if (source.numel() == 0 || (into.numel() == source.numel() && into.data_ptr() == source.data_ptr())) {
    return;  // nothing to copy; or an in-place all_gather, whose input already is its own slot
  }
  // A plain memcpy per row: PyTorch's copy may go parallel, which costs milliseconds when every
  // rank's threads share two cores.
  const size_t nbytes = static_cast<size_t>(source.numel()) * source.element_size();
  auto* row = static_cast<char*>(into.data_ptr());
  for (int64_t r = 0; r < into.numel() / source.numel(); ++r, row += nbytes) {
    std::memcpy(row, source.data_ptr(), nbytes);
  }
}

std::optional<at::Tensor> all_reduce_operand(const at::Tensor& tensor) {
  if (!plain_device_tensor(tensor)) {
    return std::nullopt;
  }
  return flat_host_view(tensor);
}

bool plain_pair(const at::Tensor& output, const at::Tensor& input, int64_t group_size, bool gather) {
  if (!plain_device_tensor(output) || !plain_device_tensor(input) || output.device() != input.device() ||
      output.scalar_type() != input.scalar_type()) {
    return false;
  }
  return gather ? output.numel() == input.numel() * group_size : input.numel() == output.numel() * group_size;
}

std::optional<std::pair<at::Tensor, at::Tensor>> pair_operands(const at::Tensor& output, const at::Tensor& input,
                                                               int64_t group_size, bool gather) {
  if (!plain_pair(output, input, group_size, gather)) {
    return std::nullopt;
  }
  return std::make_pair(flat_host_view(output), flat_host_view(input));
}

}  // namespace supa
