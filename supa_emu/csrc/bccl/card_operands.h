// torch.supa.bccl's single-process collectives: their operands checked and viewed, and the
// copies between cards, each in one native call.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>
#include <vector>

namespace supa::bccl {

// Flat CPU views of `inputs` and `outputs` (empty: none) when every tensor is a dense contiguous
// supa tensor of inputs[0]'s dtype, the inputs have one element count n and sit on distinct cards,
// and output i is on input i's card with n * input_multiplier / output_multiplier elements;
// nothing otherwise (Python then finds and raises the precise error).
std::optional<std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> card_operands(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, int64_t input_multiplier,
    int64_t output_multiplier);

// memcpy of flat contiguous CPU `source` into each of `targets` (flat contiguous CPU tensors of
// its byte size; a target that is `source` itself is skipped).
void copy_into_each(const at::Tensor& source, const std::vector<at::Tensor>& targets);

}  // namespace supa::bccl
