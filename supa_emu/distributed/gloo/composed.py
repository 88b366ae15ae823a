"""Collectives the gloo transport builds from gloo's all-to-all, where gloo lacks them or runs them slowly.

- all_reduce (SUM/AVG/PRODUCT/MIN/MAX) of buffers up to a few MiB: one pairwise exchange (an
  all-to-all in which every rank sends its whole buffer to every peer and nothing to itself), then
  a local reduction in rank order. With 2 ranks this moves the bytes of gloo's ring all_reduce in
  one round instead of several, and PyTorch's vectorised kernels reduce where gloo runs scalar
  loops. Larger buffers stay with gloo's ring, which overlaps reducing with sending and needs no
  receive buffer (see _EXCHANGE_LIMIT_TWO_RANKS).
- reduce_scatter: one all-to-all (each rank receives every rank's chunk of its own share), then a
  local reduction in rank order. gloo's own reduce_scatter all-reduces the whole input with
  scalar loops: about twice as slow for float32 and up to five times for bfloat16 there.
- all_gather: one all-to-all that sends every peer a copy of the input (with 2 ranks, an exchange
  of the inputs themselves, with no send buffer), started by the native core
  (csrc/distributed/all_gather.h; start_all_gather). Bit-exact: only placement.
- PREMUL_SUM: each rank's contribution was multiplied by its own factor before (in the tensor's
  dtype, as NCCL does; host_memory.contribution), so the reductions treat it as SUM.

Every rank folds the contributions in the same (rank) order, so all ranks hold bit-identical
results. With 2 ranks they are also gloo's bits (each reduction is one commutative step), except
that MIN/MAX of -0.0 and 0.0 give the later rank's zero where gloo's pick varies with the
element's position; with more ranks, float sums and products may differ from gloo's ring order in
the last bit.
"""

import datetime
from typing import Dict, List

import torch
import torch.distributed as dist

from supa_emu import process_state

from ..host_memory import HostCall

_RedOp = dist.ReduceOp.RedOpType

# The reductions computed locally, as out-of-place kernels with `out=`; AVG sums, then divides.
_LOCAL_REDUCTIONS = {
    _RedOp.SUM: torch.add,
    _RedOp.PREMUL_SUM: torch.add,  # the contributions were premultiplied
    _RedOp.AVG: torch.add,
    _RedOp.PRODUCT: torch.mul,
    _RedOp.MIN: torch.minimum,
    _RedOp.MAX: torch.maximum,
}

# The most a rank sends in one all_reduce exchange, by group size. Measured on 2 cores against
# gloo's all_reduce (float32 and bfloat16): with 2 ranks the exchange took 0.4-0.9x gloo's time
# from 64 KiB to 8 MiB and 1.35-1.5x from 16 MiB (a fresh receive buffer of that size costs its
# page faults); with 3 and 4 ranks, 0.3-0.85x up to 1 MiB sent per rank and 1.2-2x from 2 MiB up.
_EXCHANGE_LIMIT_TWO_RANKS = 8 << 20
_EXCHANGE_LIMIT_MORE_RANKS = 1 << 20


def reduces_locally(kind: _RedOp, dtype: torch.dtype) -> bool:
    if dtype == torch.bool or (dtype.is_complex and kind in (_RedOp.MIN, _RedOp.MAX)):
        return False
    return kind in _LOCAL_REDUCTIONS


def all_reduce_exchanges(kind: _RedOp, dtype: torch.dtype, numel: int, size: int) -> bool:
    """Whether all_reduce runs as a pairwise exchange (decided alike on every rank, and by the
    stand-in from a peer's signature)."""
    if size < 2 or not reduces_locally(kind, dtype):
        return False
    sent = (size - 1) * numel * dtype.itemsize
    return sent <= (_EXCHANGE_LIMIT_TWO_RANKS if size == 2 else _EXCHANGE_LIMIT_MORE_RANKS)


def _fold_in_rank_order(out: torch.Tensor, contributions: List[torch.Tensor], kind: _RedOp) -> None:
    """out = c[0] op c[1] op ... op c[n-1], left to right; `out` may be c[0] or c[1] (each is read
    before it is overwritten), but no later contribution."""
    reduce = _LOCAL_REDUCTIONS[kind]
    if len(contributions) == 1:
        out.copy_(contributions[0])
    else:
        reduce(contributions[0], contributions[1], out=out)
        for contribution in contributions[2:]:
            reduce(out, contribution, out=out)
    if kind == _RedOp.AVG:
        floating = out.dtype.is_floating_point or out.dtype.is_complex
        out.div_(len(contributions), rounding_mode=None if floating else "trunc")


# gloo reads an options object when an operation starts and keeps none: one per timeout serves
# every call (a training job uses one or two timeouts).
_ALL_TO_ALL_OPTIONS: Dict[datetime.timedelta, dist.AllToAllOptions] = {}


def _all_to_all_options(timeout: datetime.timedelta) -> dist.AllToAllOptions:
    options = _ALL_TO_ALL_OPTIONS.get(timeout)
    if options is None:
        options = dist.AllToAllOptions()
        options.timeout = timeout
        if len(_ALL_TO_ALL_OPTIONS) < 64:
            _ALL_TO_ALL_OPTIONS[timeout] = options
    return options


def exchange_splits(rank: int, size: int, numel: int) -> List[int]:
    splits = [numel] * size
    splits[rank] = 0
    return splits


def all_reduce(gloo, buffer: torch.Tensor, kind: _RedOp, call: HostCall, timeout: datetime.timedelta) -> dist.Work:
    """All-reduce flat `buffer` in place by a pairwise exchange; the reduction runs in `call`'s
    epilogue."""
    rank, size, numel = gloo.rank(), gloo.size(), buffer.numel()
    received = torch.empty((size - 1) * numel, dtype=buffer.dtype)
    # With 2 ranks the buffer itself is what the peer receives: no copy.
    send = buffer if size == 2 else replicated(buffer, size - 1)

    def reduce():
        # unbind, not list(): Tensor.__iter__ costs microseconds more, on every all_reduce.
        peers = [received] if size == 2 else list(received.view(size - 1, numel).unbind(0))
        # The fold may overwrite `buffer` once it has read it: at its first step (rank 0 or 1).
        own = buffer if rank < 2 else buffer.clone()
        _fold_in_rank_order(buffer, peers[:rank] + [own] + peers[rank:], kind)

    call.after(reduce)
    splits = exchange_splits(rank, size, numel)
    return gloo.alltoall_base(received, send, splits, splits, _all_to_all_options(timeout))


def reduce_scatter(gloo, output: torch.Tensor, input: torch.Tensor, kind: _RedOp, call: HostCall,
                   timeout: datetime.timedelta) -> dist.Work:
    """Reduce-scatter flat `input` into flat `output`; the reduction runs in `call`'s epilogue."""
    received = torch.empty_like(input)
    call.after(lambda: _fold_in_rank_order(output, list(received.view(gloo.size(), -1).unbind(0)), kind))
    return gloo.alltoall_base(received, input, [], [], _all_to_all_options(timeout))


def start_all_gather(gloo, output: torch.Tensor, input: torch.Tensor, options):
    """gloo's work gathering flat CPU `input` from every rank into flat CPU `output`, by one
    all-to-all the native core sets up (csrc/distributed/all_gather.h)."""
    return process_state.core()._start_all_gather(gloo, output, input, options)


def launch_all_gather(board, k: int, signature: List[int], head: int, gloo, output, input, options):
    """The launcher of an all_gather_into_tensor for signatures.Agreement.launch: checks that
    `output` and `input` are plain (as host_memory.plain_pair_operands), posts `signature` as
    collective k on the native `board` and, if it may start, starts it as start_all_gather, all in
    one native call.
    None if the operands are not plain (nothing posted), else (board status, gloo's work or None)."""
    return process_state.core()._launch_all_gather(board, k, signature, head, gloo, output, input, options)


def replicated(source: torch.Tensor, copies: int) -> torch.Tensor:
    """A flat CPU buffer holding `copies` copies of contiguous CPU `source` (plain memcpy: PyTorch's
    copy may go parallel, which costs milliseconds when ranks share few cores)."""
    rows = torch.empty(copies * source.numel(), dtype=source.dtype)
    process_state.core()._copy_rows(rows, source)
    return rows
