// Host-side operands of the bccl backend's hot collectives, checked and built in one call.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace supa {

// Whether an all_gather's (gather=true) or reduce_scatter's output and input are dense contiguous
// supa tensors of one device and dtype whose element counts fit the collective.
bool plain_pair(const at::Tensor& output, const at::Tensor& input, int64_t group_size, bool gather);
// Flat CPU views when the operands are dense contiguous supa tensors that fit the collective;
// nothing otherwise.
std::optional<at::Tensor> all_reduce_operand(const at::Tensor& tensor);
std::optional<std::pair<at::Tensor, at::Tensor>> pair_operands(const at::Tensor& output, const at::Tensor& input,
                                                               int64_t group_size, bool gather);
// Fills contiguous CPU `into` with copies of contiguous CPU `source`, one after another (memcpy).
void copy_rows(at::Tensor& into, const at::Tensor& source);

}  // namespace supa
