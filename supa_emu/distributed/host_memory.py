"""Host-memory access to emulated device tensors: the one seam between bccl and the native core.

An emulated card keeps its memory in host RAM, so gloo can read and write a device tensor's bytes
through a CPU tensor that aliases them. Everything in this package reaches device memory through
`host_view()` and asks `is_device_tensor()` which tensors it may accept; nothing else here knows
how the alias is made. `HostCall` gathers one call's views and stages the layouts a transport
cannot address in place (non-contiguous tensors) through contiguous host buffers.
"""

from typing import Callable, List, Optional

import torch

from supa_emu import process_state
from supa_emu.device_type import DEVICE_TYPE


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """Return a CPU tensor aliasing `tensor`'s memory (same sizes, strides and offset).

    Writes through the view are visible on `tensor`; the caller keeps `tensor` alive while the
    view is in use, since the view does not own the memory.
    """
    return process_state.core()._host_view(tensor)


def plain_pair(output: torch.Tensor, input: torch.Tensor, group_size: int, gather: bool) -> bool:
    """Whether `output` and `input` are the plain case of plain_pair_operands, checked natively
    (a fraction of the Python checks' cost)."""
    return process_state.core()._plain_pair(output, input, group_size, gather)


def plain_pair_operands(output: torch.Tensor, input: torch.Tensor, group_size: int, gather: bool):
    """Flat CPU views of `output` and `input`, checked and built natively in one call (Python
    checks cost tens of microseconds a call), when both are dense contiguous device tensors of one
    dtype whose element counts fit the collective: output numel == input numel x group_size for
    an all_gather (gather=True), input numel == output numel x group_size for a reduce_scatter.
    None for anything else: the caller checks (and raises) and stages.
    """
    return process_state.core()._pair_operands(output, input, group_size, gather)


def start_all_gather(gloo, output: torch.Tensor, input: torch.Tensor, options):
    """gloo's work gathering flat CPU `input` from every rank into flat CPU `output`, by one
    all-to-all the native core sets up (csrc/bccl/all_gather.h)."""
    return process_state.core()._start_all_gather(gloo, output, input, options)


def launch_all_gather(board, k: int, signature: List[int], head: int, gloo, output, input, options):
    """The launcher of an all_gather_into_tensor for signatures.Agreement.launch: checks that
    `output` and `input` are plain (as plain_pair_operands), posts `signature` as collective k on
    the native `board` and, if it may start, starts it as start_all_gather, all in one native call.
    None if the operands are not plain (nothing posted), else (board status, gloo's work or None)."""
    return process_state.core()._launch_all_gather(board, k, signature, head, gloo, output, input, options)


def replicated(source: torch.Tensor, copies: int) -> torch.Tensor:
    """A flat CPU buffer holding `copies` copies of contiguous CPU `source` (plain memcpy: PyTorch's
    copy may go parallel, which costs milliseconds when ranks share few cores)."""
    rows = torch.empty(copies * source.numel(), dtype=source.dtype)
    process_state.core()._copy_rows(rows, source)
    return rows


def is_device_tensor(tensor: torch.Tensor) -> bool:
    return tensor.device.type == DEVICE_TYPE


def device() -> torch.device:
    return torch.device(DEVICE_TYPE)


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
        if not self._fixups and not self._writebacks:
            return None
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
