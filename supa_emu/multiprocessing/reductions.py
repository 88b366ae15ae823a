"""Pickling of supa tensors, storages and events for torch.multiprocessing (the SUPA side of
CUDA IPC), installed into `torch.multiprocessing.reductions` the way the real torch_supa does.

A supa tensor is sent as a handle to its storage's memory: the storage moves into a shared
memory block (see csrc/runtime/ipc_memory.cpp) whose file descriptor travels with the message,
and the receiver maps the same bytes, so writes on either side are seen by the other. As in
CUDA IPC, every message holds a reference on the block until the receiver has mapped it (or
found it already mapped), and the sender keeps counting the memory on its device until the
block is released everywhere (`torch.supa.ipc_collect()` frees blocks left behind).
What cannot be shared raises while the sender pickles, as CUDA does.
"""

from __future__ import annotations

import multiprocessing.reduction
import os

import torch
import torch.multiprocessing.reductions as torch_reductions
from torch.multiprocessing.reductions import StorageWeakRef, shared_cache

from supa_emu import process_state
from supa_emu.device_type import DEVICE_TYPE

__all__ = ["rebuild_supa_event", "rebuild_supa_tensor"]

# torch's own reductions, for everything that is not on supa.
_torch_reduce_tensor = torch_reductions.reduce_tensor
_torch_reduce_storage = torch_reductions.reduce_storage
_torch_reduce_event = torch_reductions.reduce_event

_NON_LEAF = ("Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
             "support crossing process boundaries.  If you just want to transfer the data, call detach() "
             "on the tensor before serializing (e.g., putting it on the queue).")
# The real package's text, "NPU" included.
_STORAGE = "Cannot pickle NPU storage; try pickling a NPU tensor instead"


_native = process_state.core


def _block_id(fd: int) -> tuple[int, int]:
    # Names the shared block the same way in every process (inode of the memory file).
    stat = os.fstat(fd)
    return (stat.st_ino, stat.st_dev)


# ---------------------------------------------------------------------------------------------
# Storage IPC primitives (torch.UntypedStorage._share_supa_ and friends).

def _share_supa_(self: torch.UntypedStorage) -> tuple[int, int, int]:
    """Share this supa storage with other processes: returns `(device, fd, nbytes)`.

    The first call moves the storage's memory into a shared block (same statistics, same data,
    the tensors over it unchanged). Each call counts one pending reference that the receiver
    takes over in `_new_shared_supa` or drops with `_release_ipc_counter_supa`. `fd` belongs
    to the storage and is valid while the storage lives; it is -1 for an empty storage.
    """
    if self.device.type != DEVICE_TYPE:
        raise RuntimeError(f"_share_supa_: only available on SUPA, got a storage on {self.device}")
    fd, nbytes = _native()._ipc_export(self)
    return self.device.index, fd, nbytes


def _new_shared_supa(cls, device: int, fd: int, nbytes: int) -> torch.UntypedStorage:
    """Map a storage shared by `_share_supa_` (in any process); takes over one pending reference.

    `fd` is not taken over. The storage is not resizable (a resize would stop the sharing)."""
    from supa_emu import supa

    supa._lazy_init()
    return _native()._ipc_import(fd, nbytes, device)


def _release_ipc_counter_supa(self: torch.UntypedStorage) -> None:
    """Drop one pending reference of this shared storage (a message that found it mapped)."""
    _native()._ipc_release_pending(self)


# ---------------------------------------------------------------------------------------------
# Tensors.

def rebuild_supa_tensor(tensor_cls, size, stride, storage_offset, dtype, device, handle, block_id, nbytes,
                        requires_grad, conj, neg):
    """Receiver side of `reduce_tensor`: the tensor over the sender's memory on `supa:<device>`."""
    if handle is None:
        storage = torch.UntypedStorage(0, device=torch.device(DEVICE_TYPE, device))
    else:
        fd = handle.detach()
        try:
            storage = torch_reductions.storage_from_cache(torch.UntypedStorage, block_id)
            if storage is not None and not _native()._ipc_is_shared(storage):
                storage = None  # the cached storage was resized since: it no longer maps the block
            if storage is not None:
                _release_ipc_counter_supa(storage)
            else:
                storage = _new_shared_supa(torch.UntypedStorage, device, fd, nbytes)
                shared_cache[block_id] = StorageWeakRef(storage)
        finally:
            os.close(fd)
    t = torch.empty((0,), dtype=dtype, device=storage.device).set_(storage, storage_offset, size, stride)
    if conj:
        t = t.conj()
    if neg:
        t = torch._neg_view(t)
    if tensor_cls is torch.nn.parameter.Parameter:
        # Through the constructor: integer parameters must not get requires_grad set afterwards.
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad = requires_grad
    return t


def reduce_tensor(tensor: torch.Tensor):
    """Pickle a tensor for another process: strided supa tensors by shared memory, the rest by
    torch's own reduction (sparse and nested tensors come back here for their parts)."""
    if tensor.device.type != DEVICE_TYPE or tensor.layout != torch.strided or tensor.is_nested:
        return _torch_reduce_tensor(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(_NON_LEAF)
    torch.utils.hooks.warn_if_has_hooks(tensor)
    storage = tensor.untyped_storage()
    device, fd, nbytes = _share_supa_(storage)
    if fd < 0:
        handle, block_id = None, None
    else:
        block_id = _block_id(fd)
        shared_cache[block_id] = StorageWeakRef(storage)
        handle = multiprocessing.reduction.DupFd(fd)
    return (rebuild_supa_tensor,
            (type(tensor), tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(), tensor.dtype,
             device, handle, block_id, nbytes, tensor.requires_grad, tensor.is_conj(), tensor.is_neg()))


def reduce_storage(storage):
    """Storages travel inside tensors only (their dtype and geometry are the tensor's)."""
    if storage.device.type == DEVICE_TYPE:
        raise RuntimeError(_STORAGE)
    return _torch_reduce_storage(storage)


# ---------------------------------------------------------------------------------------------
# Events.

def rebuild_supa_event(device: int, handle: bytes):
    return torch.supa.Event.from_ipc_handle(device, handle)


def reduce_event(event):
    """A supa event travels as its IPC handle (it needs interprocess=True and a record)."""
    from supa_emu.supa.streams import Event

    if not isinstance(event, Event):
        return _torch_reduce_event(event)
    handle = event.ipc_handle()
    return (rebuild_supa_event, (event.device.index, handle))


def install() -> None:
    """Make torch.multiprocessing pickle supa objects with the functions above (idempotent)."""
    from multiprocessing.reduction import ForkingPickler

    from supa_emu.supa.streams import Event

    torch.UntypedStorage._share_supa_ = _share_supa_
    torch.UntypedStorage._new_shared_supa = classmethod(_new_shared_supa)
    torch.UntypedStorage._release_ipc_counter_supa = _release_ipc_counter_supa
    torch_reductions.reduce_tensor = reduce_tensor
    torch_reductions.reduce_storage = reduce_storage
    torch_reductions.reduce_event = reduce_event
    torch_reductions.init_reductions()
    ForkingPickler.register(Event, reduce_event)
