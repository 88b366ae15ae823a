#include "all_gather.h"

#include "../runtime/host_alias.h"
#include "collective_operands.h"

#include <ATen/ops/empty.h>

namespace supa::bccl {

c10::intrusive_ptr<c10d::Work> start_all_gather(c10d::Backend& gloo, at::Tensor output, at::Tensor input,
                                                const c10d::AllgatherOptions& options) {
  const int64_t rank = gloo.getRank(), size = gloo.getSize(), n = input.numel();
  TORCH_CHECK(output.dim() == 1 && input.dim() == 1 && output.is_contiguous() && input.is_contiguous() &&
                  output.numel() == size * n && output.scalar_type() == input.scalar_type(),
              "bccl: start_all_gather expects flat contiguous tensors of one dtype, the output ", size,
              " times the input's size");
  c10d::AllToAllOptions all_to_all;
  all_to_all.timeout = options.timeout;
  if (size == 2) {
    at::Tensor peer_slot = flat_host_slice(output, (1 - rank) * n, n);
    // Two vectors: gloo takes its split arguments by reference and moves from them.
    std::vector<int64_t> receive{rank == 0 ? 0 : n, rank == 0 ? n : 0};  // nothing to itself
    std::vector<int64_t> send = receive;
    auto work = gloo.alltoall_base(peer_slot, input, receive, send, all_to_all);
    // The own slot is filled while gloo's thread moves the peer's: both only read the input and
    // write disjoint slots. In place (the input is the own slot), copy_rows skips the copy.
    at::Tensor own_slot = flat_host_slice(output, rank * n, n);
    copy_rows(own_slot, input);
    return work;
  }
  at::Tensor replicas = at::empty({size * n}, input.options());
  copy_rows(replicas, input);
  std::vector<int64_t> even_receive, even_send;
  return gloo.alltoall_base(output, replicas, even_receive, even_send, all_to_all);
}

std::optional<std::pair<int, c10::intrusive_ptr<c10d::Work>>> launch_all_gather(
    const SignatureBoard& board, int64_t k, const std::vector<int64_t>& signature, int64_t head, c10d::Backend& gloo,
    const at::Tensor& output, const at::Tensor& input, const c10d::AllgatherOptions& options) {
  auto operands = pair_operands(output, input, board.size(), /*gather=*/true);
  if (!operands) {
    return std::nullopt;
  }
  const int status = board.post(k, signature, head);
  if (status != 1) {
    return std::make_pair(status, c10::intrusive_ptr<c10d::Work>());
  }
  return std::make_pair(status, start_all_gather(gloo, operands->first, operands->second, options));
}

}  // namespace supa::bccl
