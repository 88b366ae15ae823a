"""The emulated `torch_supa._C`: the native entry points of the real package that code calls by name.

Only the ones the emulator answers are here; the rest of the real `_C` (docs/real_stack.md) is
reached through `torch.supa`.
"""

import torch

from supa_emu.supa import _mem_pool, _runtime


def _supa_getCurrentBlasHandle() -> int:
    """This thread's BLAS handle on the current device."""
    return _runtime.current_blas_handle()


def _supa_clearSublasWorkspaces() -> None:
    """Free every BLAS workspace (as torch._C._cuda_clearCublasWorkspaces on CUDA)."""
    _runtime._clear_sublas_workspaces()


def _host_emptyCache() -> None:
    """Release the pinned host blocks the caching host allocator keeps unused (torch._C._host_emptyCache
    of a CUDA build; the pinned allocator is PyTorch's, registered for supa)."""
    torch.accelerator.empty_host_cache()


_supa_beginAllocateCurrentThreadToPool = _mem_pool._begin_allocate_current_thread_to_pool
_supa_endAllocateToPool = _mem_pool._end_allocate_to_pool
_supa_releasePool = _mem_pool._release_pool
_supa_checkPoolLiveAllocations = _mem_pool._check_pool_live_allocations
