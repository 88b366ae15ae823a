"""Host-memory access to a group's tensors, for the transports: the one seam between them and the native core.

An emulated card keeps its memory in host RAM, so a transport can read and write a device
tensor's bytes through a CPU tensor that aliases them (a host tensor is its own). The transports
reach tensor memory through `host_view()` only; nothing else knows how the alias is made.
`HostCall` gathers one call's views and stages the layouts a transport cannot address in place
(non-contiguous tensors) through contiguous host buffers; `contribution` is what a rank adds to
a reduction, computed on those views.
"""

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from supa_emu import process_state

_RedOp = dist.ReduceOp.RedOpType


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return a CPU tensor aliasing `tensor`'s memory (same sizes, strides and offset).

    Writes through the view are visible on `tensor`; the caller keeps `tensor` alive while the
    view is in use, since the view does not own the memory.
    """
    if tensor.device.type == "cpu":
        return tensor.detach()  # collectives write their outputs outside autograd, as c10d's do
    return process_state.core()._host_view(tensor)


def plain_pair_operands(output: torch.Tensor, input: torch.Tensor, group_size: int, gather: bool):
    """Flat CPU views of `output` and `input`, checked and built natively in one call (Python
    checks cost tens of microseconds a call), when both are dense contiguous device tensors of one
    dtype whose element counts fit the collective: output numel == input numel x group_size for
    an all_gather (gather=True), input numel == output numel x group_size for a reduce_scatter.
    None for anything else: the caller checks (and raises) and stages.
    """
    return process_state.core()._pair_operands(output, input, group_size, gather)


def contribution(view: torch.Tensor, reduce_op, kind: _RedOp, in_place: bool) -> torch.Tensor:
    """What a rank contributes to a reduction from host `view`: for PREMUL_SUM (`kind`), the view
    times the factor of `reduce_op` (checked by the record), in the view's dtype as NCCL
    premultiplies (in place for a buffer the result overwrites; the ranks then SUM); any other
    reduction's contribution is the view itself."""
    if kind != _RedOp.PREMUL_SUM:
        return view
    factor = reduce_op.factor
    if isinstance(factor, torch.Tensor):
        factor = host_view(factor).item()
    if view.dtype == torch.float16:
        factor = float(torch.tensor(factor, dtype=torch.float16))  # NCCL takes a half factor for half inputs
    # A Python number multiplies in the dtype's compute type (float for half and bfloat16), as
    # NCCL's premultiplication does, with one rounding to the dtype.
    return torch.mul(view, factor, out=view if in_place else None)


class HostCall:
    """The host side of one call: the views a transport works on, and the fix-ups and write-backs
    that complete it (run by the work once the transport's operations are done)."""

    def __init__(self):
        self._fixups: List[Callable[[], None]] = []
        self._writebacks = []

    def elementwise_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """Like `view` (read and written) for operations that ignore shape (gloo's all_reduce): a
        dense contiguous tensor gets a flat view, built natively in one call."""
        plain = process_state.core()._all_reduce_operand(tensor)
        return self.view(tensor) if plain is None else plain

    def view(self, tensor: torch.Tensor, read: bool = True, write: bool = True) -> torch.Tensor:
        """A contiguous CPU view of `tensor`, or a staging buffer (filled from it if `read`,
        written back to it at the end if `write`) where the layout is not contiguous."""
        view = host_view(tensor)
        if view.is_contiguous():
            return view
        staged = view.contiguous() if read else torch.empty(view.shape, dtype=view.dtype)
        if write:
            self._writebacks.append((view, staged))
        return staged

    def pair_views(self, output: torch.Tensor, input: torch.Tensor, group_size: int, gather: bool):
        """Flat CPU views of an all_gather's (gather=True) or reduce_scatter's checked output and
        input: built natively in one call where both are contiguous, else through `view`."""
        plain = plain_pair_operands(output, input, group_size, gather)
        if plain is not None:
            return plain
        return flat(self.view(output, read=False)), flat(self.view(input, write=False))

    def after(self, fixup: Callable[[], None]) -> None:
        self._fixups.append(fixup)

    def epilogue(self) -> Optional[Callable[[], None]]:
        if not self._writebacks:
            if not self._fixups:
                return None
            if len(self._fixups) == 1:
                return self._fixups[0]  # the common composed reduction: no wrapper to call
        fixups, writebacks = self._fixups, self._writebacks

        def run():
            for fixup in fixups:
                fixup()
            for view, staged in writebacks:
                view.copy_(staged)

        return run


def flat(view: torch.Tensor) -> torch.Tensor:
    """`view` (contiguous) as one dimension, without a copy (gloo wants flat buffers)."""
    return view if view.dim() == 1 else view.view(-1)
