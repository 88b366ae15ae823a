"""Copies between the SUPA cards of one process: broadcast, scatter and gather for DataParallel.

`torch.nn.parallel.comm` (and so `torch.nn.DataParallel`) calls the native entry points
`torch._C._broadcast`, `_broadcast_out`, `_broadcast_coalesced`, `_scatter`, `_scatter_out`,
`_gather` and `_gather_out`, which a CPU build of PyTorch does not have. The real torch_supa
provides them for SUPA cards and transfer_to_supa installs them on torch._C; these are the
emulator's versions, with the semantics of PyTorch's CUDA implementations: results on the
source device are the source tensors themselves, devices are given as indices, and a negative
index means the CPU. Where PyTorch broadcasts between cards with NCCL, these go through
`torch.supa.bccl` (a broadcast of the tensor, or of coalesced buffers, to every card at once).
Streams are accepted and ignored: the emulator's copies are synchronous, so no stream could
still be using a result.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _reorder_tensors_as, _take_tensors, _unflatten_dense_tensors

from supa_emu.device_type import DEVICE_TYPE
from supa_emu.supa import bccl

__all__ = ["broadcast", "broadcast_out", "broadcast_coalesced", "scatter", "scatter_out", "gather", "gather_out"]


def _device(index: int) -> torch.device:
    return torch.device("cpu") if index < 0 else torch.device(DEVICE_TYPE, index)


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    """`tensor` on every device of `devices`; where it already lives, the tensor itself."""
    if bccl.is_available([tensor]) and devices and tensor.get_device() == devices[0]:
        copies = [tensor] + [torch.empty_like(tensor, device=_device(index)) for index in devices[1:]]
        bccl.broadcast(copies)
        return copies
    return [tensor if tensor.device == _device(index) else tensor.to(_device(index), copy=True) for index in devices]


def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies `tensor` into every tensor of `out` (same shapes required) and returns `out`."""
    for target in out:
        if target.shape != tensor.shape:
            raise RuntimeError(f"output tensor of shape {tuple(target.shape)} does not match the broadcast "
                               f"tensor's shape {tuple(tensor.shape)}")
    if bccl.is_available([tensor, *out]) and tensor.dtype == out[0].dtype:
        bccl.broadcast([tensor, *out])
    else:
        for target in out:
            target.copy_(tensor)
    return list(out)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                        buffer_size: int = 10485760) -> list[list[torch.Tensor]]:
    """One list per device of `tensors` copied there (the first device must hold the sources):
    dense tensors travel flattened, up to `buffer_size` bytes a buffer, one broadcast per buffer.
    The copies are views of those buffers with version counters of their own."""
    if any(t.device != _device(devices[0]) for t in tensors):
        raise RuntimeError("broadcast_coalesced: all tensors must be on devices[0] "
                           f"({_device(devices[0])}), got {[str(t.device) for t in tensors]}")
    outputs = [list(tensors)] + [[] for _ in devices[1:]]
    for chunk in _take_tensors(tensors, buffer_size):
        if chunk[0].is_sparse:
            copies = [[t.to(_device(index), copy=True) for t in chunk] for index in devices[1:]]
        else:
            flats = broadcast(_flatten_dense_tensors(chunk), devices)[1:]
            copies = [[t.data for t in _unflatten_dense_tensors(flat, chunk)] for flat in flats]
        for device_outputs, device_copies in zip(outputs[1:], copies):
            device_outputs.extend(device_copies)
    return [outputs[0]] + [_reorder_tensors_as(device_outputs, tensors) for device_outputs in outputs[1:]]


def _chunk_sizes(size: int, parts: int) -> list[int]:
    chunk = -(-size // parts)  # torch.chunk's rule: equal chunks, the last one smaller
    sizes = [min(chunk, size - i * chunk) for i in range(parts)]
    return [s for s in sizes if s > 0]


def scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Optional[Sequence[int]] = None,
            dim: int = 0, streams=None) -> list[torch.Tensor]:
    """Splits `tensor` along `dim` (in `chunk_sizes`, or equally) and puts chunk i on devices[i]."""
    sizes = list(chunk_sizes) if chunk_sizes is not None else _chunk_sizes(tensor.size(dim), len(devices))
    if sum(sizes) != tensor.size(dim):
        raise RuntimeError(f"scatter: chunk sizes {sizes} do not add up to the size {tensor.size(dim)} of dim {dim}")
    chunks = tensor.split(sizes, dim)
    return [chunk.to(_device(index), copy=True).contiguous() if chunk.device != _device(index) else chunk
            for chunk, index in zip(chunks, devices)]


def scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int = 0, streams=None) -> list[torch.Tensor]:
    """Splits `tensor` along `dim` into the tensors of `out` (their sizes give the split)."""
    for chunk, target in zip(tensor.split([t.size(dim) for t in out], dim), out):
        target.copy_(chunk)
    return list(out)


def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination_index: int = -1) -> torch.Tensor:
    """Concatenates `tensors` along `dim` on the destination device (an index; -1: the CPU)."""
    destination = _device(destination_index)
    return torch.cat([t.to(destination) for t in tensors], dim)


def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Concatenates `tensors` along `dim` into `out`."""
    return torch.cat([t.to(out.device) for t in tensors], dim, out=out)
