// bccl's all_gather_into_tensor on gloo, and its launch straight from the signature board.
#pragma once

#include "signature_board.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <optional>
#include <utility>

namespace supa::bccl {

// Starts gathering flat contiguous CPU `input` from every rank of `gloo` into flat contiguous CPU
// `output` (group size x as many elements), as one all-to-all: gloo's all-to-all moves the same
// bytes as its ring all_gather, 15-30% faster from 64 KiB to 4 MiB on 2 cores. With 2 ranks it is
// an exchange of the inputs themselves (the own slot is filled here, no send buffer); with more,
// every peer is sent a copy of the input. The peers must call it with as many elements.
c10::intrusive_ptr<c10d::Work> start_all_gather(c10d::Backend& gloo, at::Tensor output, at::Tensor input,
                                                const c10d::AllgatherOptions& options);

// The whole launch of an all_gather_into_tensor of supa tensors, for the board's early start:
// nothing if the operands are not dense contiguous supa tensors of one dtype whose sizes fit the
// group (then nothing is posted, and the caller checks and stages them); else posts `signature`
// as collective k and returns (status, work): `status` as SignatureBoard::post's with `head`
// (-1: the ring slot is still in use, nothing posted; 0: refused; 1: started), `work` gloo's when
// started. One native call costs a few microseconds where the same steps from Python cost tens.
std::optional<std::pair<int, c10::intrusive_ptr<c10d::Work>>> launch_all_gather(
    const SignatureBoard& board, int64_t k, const std::vector<int64_t>& signature, int64_t head, c10d::Backend& gloo,
    const at::Tensor& output, const at::Tensor& input, const c10d::AllgatherOptions& options);

}  // namespace supa::bccl
