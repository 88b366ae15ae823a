// Host-side operands of bccl's hot collectives, checked and built in one call.
//
// bccl hands gloo CPU views of supa tensors. For the common case (dense, contiguous supa
// tensors of one dtype on one device, with the element counts the collective needs) the checks
// and views cost a few microseconds here against tens in Python, where every collective call
// paid them. Anything else returns nothing, and Python takes its slow path, which raises the
// precise error or stages layouts gloo cannot address.
#include "runtime.h"

#include <ATen/ops/empty.h>

#include <cstring>

namespace supa {
namespace {

bool plain_device_tensor(const at::Tensor& t) {
  return t.defined() && t.device().type() == kSupa && t.layout() == c10::kStrided && t.is_contiguous();
}

at::Tensor flat_host_view(const at::Tensor& t) {
  return host_view(t).view({-1});
}

}  // namespace

at::Tensor replicated(const at::Tensor& source, int64_t group_size) {
  TORCH_CHECK(source.device().is_cpu() && source.is_contiguous(), "replicated expects a contiguous CPU tensor");
  // A plain memcpy per row: PyTorch's copy may go parallel, which costs milliseconds when every
  // rank's threads share two cores.
  at::Tensor rows = at::empty({group_size * source.numel()}, source.options());
  const size_t nbytes = static_cast<size_t>(source.numel()) * source.element_size();
  auto* row = static_cast<char*>(rows.data_ptr());
  for (int64_t r = 0; r < group_size; ++r, row += nbytes) {
    std::memcpy(row, source.data_ptr(), nbytes);
  }
  return rows;
}

std::optional<at::Tensor> all_reduce_operand(const at::Tensor& tensor) {
  if (!plain_device_tensor(tensor)) {
    return std::nullopt;
  }
  return flat_host_view(tensor);
}

std::optional<std::pair<at::Tensor, at::Tensor>> all_gather_operands(const at::Tensor& output, const at::Tensor& input,
                                                                     int64_t group_size) {
  if (!plain_device_tensor(output) || !plain_device_tensor(input) || output.device() != input.device() ||
      output.scalar_type() != input.scalar_type() || output.numel() != input.numel() * group_size) {
    return std::nullopt;
  }
  // What every peer receives: one copy of the input per rank, sent as one all-to-all.
  return std::make_pair(flat_host_view(output), replicated(host_view(input), group_size));
}

std::optional<std::pair<at::Tensor, at::Tensor>> reduce_scatter_operands(const at::Tensor& output,
                                                                         const at::Tensor& input, int64_t group_size) {
  if (!plain_device_tensor(output) || !plain_device_tensor(input) || output.device() != input.device() ||
      output.scalar_type() != input.scalar_type() || input.numel() != output.numel() * group_size) {
    return std::nullopt;
  }
  return std::make_pair(flat_host_view(output), flat_host_view(input));
}

}  // namespace supa
