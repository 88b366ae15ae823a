"""What `torch.supa.bccl`'s collectives do to the bytes, over host views of the cards' memory.

An emulated card keeps its memory in host RAM, so a copy between cards is a host memcpy between
CPU views of the two tensors (`_host_view`, no copy) and a reduction is PyTorch's CPU kernels on
those views, with the result written straight into the output card's memory. Reductions run in
rank order in the tensors' own dtype (each step rounded, as BCCL's ring does); AVG is NCCL's:
floating types are scaled by 1/n as they are added, integer types are summed and then divided
(truncating). Everything here takes checked arguments from `bccl` and ranks in communicator order.

Only an input and the output on the same card can share memory; where they overlap other than
as the very buffer an element-wise kernel may read and write at once, the result is staged.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from supa_emu import process_state

SUM, PROD, MAX, MIN, AVG = range(5)  # ncclRedOp_t codes

# BCCL moves these as bytes (NCCL's uint8): reductions act on the byte values.
BYTE_DTYPES = frozenset(
    [torch.bool] + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, name)])
NUMERIC_DTYPES = frozenset([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                            torch.int8, torch.uint8])


_native = process_state.core


def as_operand(view: torch.Tensor) -> torch.Tensor:
    """A flat host view as the kernels take it: bytes for BYTE_DTYPES."""
    return view.view(torch.uint8) if view.dtype in BYTE_DTYPES else view


def flat_host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat CPU tensor over `tensor`'s memory (contiguous `tensor` required), as an operand."""
    return as_operand(_native()._host_view(tensor).view(-1))


def checked_operands(inputs, outputs, input_multiplier: int, output_multiplier: int):
    """(input views, output views) when all tensors pass torch.cuda.nccl's checks (one native
    call), else None; `outputs` may be empty."""
    return _native()._card_operands(inputs, outputs, input_multiplier, output_multiplier)


def _copy_into_each(source: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    _native()._copy_into_each(source, list(targets))


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1 and a.numel() > 0 and b.numel() > 0


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _span(a) == _span(b)


def _reduce_in_order(dest: torch.Tensor, sources: Sequence[torch.Tensor], op: int) -> None:
    """dest = sources[0] op sources[1] op ...; dest may be the very buffer of sources[0] only."""
    first, rest = sources[0], sources[1:]
    if op == AVG and dest.is_floating_point():
        torch.mul(first, 1.0 / len(sources), out=dest)
        for source in rest:
            dest.add_(source, alpha=1.0 / len(sources))
        return
    if not rest:
        if not _same(dest, first):
            dest.copy_(first)
    elif op in (SUM, AVG):
        torch.add(first, rest[0], out=dest)
        for source in rest[1:]:
            dest.add_(source)
    elif op == PROD:
        torch.mul(first, rest[0], out=dest)
        for source in rest[1:]:
            dest.mul_(source)
    else:
        combine = torch.maximum if op == MAX else torch.minimum
        combine(first, rest[0], out=dest)
        for source in rest[1:]:
            combine(dest, source, out=dest)
    if op == AVG:
        dest.div_(len(sources), rounding_mode="trunc")


def reduce_into(dest: torch.Tensor, sources: Sequence[torch.Tensor], op: int, own: Optional[int]) -> None:
    """Writes the reduction of `sources` (flat host views, rank order) into flat host view `dest`;
    `own`: the position of the source on dest's card (the only one it can share memory with)."""
    if own is not None and _overlap(dest, sources[own]):
        if not _same(dest, sources[own]):
            staged = torch.empty_like(dest)
            _reduce_in_order(staged, sources, op)
            dest.copy_(staged)
            return
        # The output is that input's buffer: read it first (sum order is free).
        sources = [sources[own], *sources[:own], *sources[own + 1:]]
    _reduce_in_order(dest, sources, op)


def all_reduce(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: int) -> None:
    """Every output gets the reduction of all inputs (flat host views in rank order)."""
    reduce_into(outputs[0], inputs, op, own=0)
    _copy_into_each(outputs[0], outputs[1:])


def broadcast(tensors: Sequence[torch.Tensor], root: int) -> None:
    """Every tensor gets a copy of tensors[root]."""
    _copy_into_each(tensors[root], [tensor for rank, tensor in enumerate(tensors) if rank != root])


def all_gather(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Output r is the concatenation of the inputs in rank order."""
    count = inputs[0].numel()
    sources = list(inputs)
    for rank, (source, output) in enumerate(zip(inputs, outputs)):
        if _overlap(source, output) and not _same(source, output[rank * count:(rank + 1) * count]):
            sources[rank] = source.clone()  # writing the other ranks' chunks would overwrite it
    first = outputs[0]
    for rank, source in enumerate(sources):
        _copy_into_each(source, [first[rank * count:(rank + 1) * count]])
    # The others are copies of the first (where an output holds its own input, with the same bytes).
    _copy_into_each(first, outputs[1:])


def reduce_scatter(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: int) -> None:
    """Output r is the reduction of chunk r of every input (rank order)."""
    count = outputs[0].numel()
    staged = []
    for rank, output in enumerate(outputs):
        chunks = [source[rank * count:(rank + 1) * count] for source in inputs]
        own = inputs[rank]
        # Writing over another chunk of this card's input would change what later ranks read.
        if _overlap(output, own) and not _same(output, chunks[rank]):
            staged.append((output, torch.empty_like(output)))
            reduce_into(staged[-1][1], chunks, op, own=None)
        else:
            reduce_into(output, chunks, op, own=rank)
    for output, result in staged:
        output.copy_(result)
