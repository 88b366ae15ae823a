"""Copies between the SUPA cards of one process: broadcast, scatter and gather for DataParallel.

`torch.nn.parallel.comm` (and so `torch.nn.DataParallel`) calls the native entry points
`torch._C._broadcast`, `_broadcast_out`, `_broadcast_coalesced`, `_scatter`, `_scatter_out`,
`_gather` and `_gather_out`, which a CPU build of PyTorch does not have. The real torch_supa
provides them for SUPA cards and transfer_to_supa installs them on torch._C; these are the
emulator's versions, with the semantics and argument checks of PyTorch's CUDA implementations
(torch/csrc/cuda/comm.cpp), worded for SUPA: results on the source device are the source tensors
themselves (views, for scatter), devices are given as non-negative indices (gather's destination
-1 means the CPU, None the current card), and a tensor's memory format travels with it. Where
PyTorch broadcasts between cards with NCCL, these go through `torch.supa.bccl`. A stream given
for a chunk must be on that chunk's card; the chunk's copy is made on it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import torch
from torch._prims_common import suggest_memory_format
from torch._utils import _flatten_dense_tensors, _reorder_tensors_as, _take_tensors, _unflatten_dense_tensors

from supa_emu.device_type import DEVICE_TYPE
from supa_emu.supa import bccl
from supa_emu.supa._runtime import current_device
from supa_emu.supa.streams import stream as stream_context

__all__ = ["broadcast", "broadcast_out", "broadcast_coalesced", "scatter", "scatter_out", "gather", "gather_out"]


def _card(index: int) -> torch.device:
    if index < 0:
        raise RuntimeError(f"Expected non-negative device index, but got {index}")
    return torch.device(DEVICE_TYPE, index)


def _shape(tensor: torch.Tensor) -> str:
    return str(list(tensor.shape))  # as c10 prints sizes: [2, 5]


def _wrap_dim(dim: int, tensor: torch.Tensor) -> int:
    tensor.size(dim)  # raises PyTorch's IndexError for a dimension out of range
    return dim + tensor.dim() if dim < 0 else dim


def _on_stream(streams: Optional[Sequence[Any]], i: int, device: torch.device):
    """The context that makes chunk i's copy on its stream, after checking the stream's card."""
    stream = streams[i] if streams is not None and i < len(streams) else None
    if stream is None:
        return contextlib.nullcontext()
    if stream.device_index != device.index:
        raise RuntimeError(f"Expected the device associated with the stream at index {i} (was "
                           f"{stream.device_index}) to match the device supplied at that index "
                           f"(expected {device.index})")
    return stream_context(stream)


# ---- broadcast ---------------------------------------------------------------------------------

def _copy_to_all(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> None:
    if out and bccl.is_available([tensor, *out]) and all(t.dtype == tensor.dtype for t in out):
        bccl.broadcast([tensor, *out])
    else:
        for target in out:
            target.copy_(tensor)


def broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    """`tensor` on every card of `devices`; where it already lives, the tensor itself."""
    targets = [_card(index) for index in devices]
    # empty_like keeps the source's strides, so channels_last copies stay channels_last.
    fresh = [torch.empty_like(tensor, device=target) for target in targets if target != tensor.device]
    _copy_to_all(tensor, fresh)
    copies = iter(fresh)
    return [tensor if target == tensor.device else next(copies) for target in targets]


def broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies `tensor` into every tensor of `out` (SUPA tensors of its shape) and returns `out`."""
    for i, target in enumerate(out):
        if target.device.type != DEVICE_TYPE:
            raise RuntimeError("Expected all output tensors to be SUPA tensors, but output tensor at index "
                               f"{i} has device '{target.device}'")
        if target.shape != tensor.shape:
            raise RuntimeError(f"Expected all output tensors to have same shape as the source tensor "
                               f"{_shape(tensor)}, but output tensor at index {i} has shape {_shape(target)}")
    _copy_to_all(tensor, out)
    return list(out)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                        buffer_size: int = 10485760) -> list[list[torch.Tensor]]:
    """One list per device of `tensors` copied there (the first device must hold the sources):
    dense tensors travel flattened, up to `buffer_size` bytes a buffer, one broadcast per buffer;
    sparse ones are copied one by one. The copies have version counters of their own."""
    if not devices:
        raise RuntimeError("Expected at least one device to broadcast to")
    if any(t.get_device() != devices[0] for t in tensors):
        raise RuntimeError(f"All tensors must be on devices[0]: {devices[0]}")
    outputs = [list(tensors)] + [[] for _ in devices[1:]]
    for chunk in _take_tensors(tensors, buffer_size):
        if chunk[0].is_sparse:
            copies = [[t.to(_card(index), copy=True) for t in chunk] for index in devices[1:]]
        else:
            flats = broadcast(_flatten_dense_tensors(chunk), devices)[1:]
            copies = [[t.data for t in _unflatten_dense_tensors(flat, chunk)] for flat in flats]
        for device_outputs, device_copies in zip(outputs[1:], copies):
            device_outputs.extend(device_copies)
    return [outputs[0]] + [_reorder_tensors_as(device_outputs, tensors) for device_outputs in outputs[1:]]


# ---- scatter -----------------------------------------------------------------------------------

def scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Optional[Sequence[int]] = None,
            dim: int = 0, streams: Optional[Sequence[Any]] = None) -> list[torch.Tensor]:
    """Splits `tensor` along `dim` (in `chunk_sizes`, or as torch.chunk does) and puts chunk i on
    devices[i], keeping its memory format; a chunk already there is a view of `tensor`."""
    if not devices:
        raise RuntimeError("Expected at least one device to scatter to")
    if chunk_sizes is not None and len(chunk_sizes) != len(devices):
        raise RuntimeError("Expected devices and chunk_sizes to be of same length, but got "
                           f"len(devices) = {len(devices)} and len(chunk_sizes) = {len(chunk_sizes)}")
    dim = _wrap_dim(dim, tensor)
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None else tensor.chunk(len(devices), dim)
    results = []
    for i, (chunk, index) in enumerate(zip(chunks, devices)):
        if chunk.device.type == DEVICE_TYPE and chunk.get_device() == index:
            results.append(chunk)
            continue
        target = _card(index)
        with _on_stream(streams, i, target):
            results.append(chunk.to(target, memory_format=torch.preserve_format))
    return results


def scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int = 0,
                streams: Optional[Sequence[Any]] = None) -> list[torch.Tensor]:
    """Splits `tensor` along `dim` into the SUPA tensors of `out` (their sizes at `dim` give the
    split; elsewhere they have its shape) and returns `out`."""
    if not out:
        raise RuntimeError("Expected at least one output tensor to scatter to")
    dim = _wrap_dim(dim, tensor)
    total = 0
    for i, target in enumerate(out):
        if target.device.type != DEVICE_TYPE:
            raise RuntimeError("Expected all output tensors to be SUPA tensors, but output tensor at index "
                               f"{i} has device '{target.device}'")
        same_rank = target.dim() == tensor.dim()
        if not same_rank or any(target.size(d) != tensor.size(d) for d in range(tensor.dim()) if d != dim):
            raise RuntimeError(f"Output tensor at index {i} has incorrect shape: {_shape(target)}. Expected same "
                               f"shape except for scatter dim {dim} as the source tensor: {_shape(tensor)}")
        total += target.size(dim)
    if total != tensor.size(dim):
        raise RuntimeError(f"Total size for output tensors along scatter dim {dim} does not match the source "
                           f"tensor size at dim {dim}. Expected {tensor.size(dim)}, but got total size {total}")
    for i, (chunk, target) in enumerate(zip(tensor.split([t.size(dim) for t in out], dim), out)):
        with _on_stream(streams, i, target.device):
            target.copy_(chunk)
    return list(out)


# ---- gather ------------------------------------------------------------------------------------

def _gathered_shape(tensors: Sequence[torch.Tensor], dim: int, quote_device: bool) -> tuple[list[int], int]:
    """The shape of `tensors` concatenated along `dim` (wrapped), after CUDA's checks of them."""
    if not tensors:
        raise RuntimeError("Expected at least one tensor to gather from")
    first = tensors[0]
    dim = _wrap_dim(dim, first)
    expected = list(first.shape)
    total = 0
    for i, tensor in enumerate(tensors):
        if tensor.device.type != DEVICE_TYPE:
            device = f"'{tensor.device}'" if quote_device else str(tensor.device)
            raise RuntimeError(f"Expected all input tensors to be SUPA tensors, but tensor at index {i} has "
                               f"device {device}")
        if tensor.dim() != len(expected):
            raise RuntimeError("Expected all input tensors to have the same number of dimensions, but tensor at "
                               f"index {i} has {tensor.dim()} dimensions, (expected {len(expected)})")
        expected[dim] = tensor.size(dim)
        if list(tensor.shape) != expected:
            raise RuntimeError(f"Input tensor at index {i} has invalid shape {_shape(tensor)}, but expected "
                               f"{expected}")
        total += tensor.size(dim)
    expected[dim] = total
    return expected, dim


def _concatenate_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
    for part, tensor in zip(out.split([t.size(dim) for t in tensors], dim), tensors):
        part.copy_(tensor)
    return out


def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination_index: Optional[int] = None) -> torch.Tensor:
    """Concatenates SUPA `tensors` along `dim` on the destination (a card index; -1: the CPU;
    None: the current card), in their memory format when they all share one."""
    shape, dim = _gathered_shape(tensors, dim, quote_device=False)
    formats = {suggest_memory_format(t) for t in tensors}
    memory_format = formats.pop() if len(formats) == 1 else torch.contiguous_format
    if destination_index == -1:
        destination = torch.device("cpu")
    else:
        destination = _card(current_device() if destination_index is None else destination_index)
    out = torch.empty(shape, dtype=tensors[0].dtype, device=destination, memory_format=memory_format)
    return _concatenate_into(tensors, out, dim)


def gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Concatenates SUPA `tensors` along `dim` into `out` (of the concatenation's shape)."""
    shape, dim = _gathered_shape(tensors, dim, quote_device=True)
    if list(out.shape) != shape:
        raise RuntimeError(f"Expected out tensor to have shape {shape}, but got {_shape(out)}")
    return _concatenate_into(tensors, out, dim)
