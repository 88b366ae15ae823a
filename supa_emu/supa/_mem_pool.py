"""Private memory pools: `MemPool`, `MemPoolContext`, `use_mem_pool`, and the allocator handles.

A pool is a core-numbered id (0, n). Inside `use_mem_pool(pool)` the core's allocator tags
this thread's allocations on the device with the pool's id and reuses a freed block only for
the same pool, so the pool's segments show up in `memory_snapshot()` with its
`segment_pool_id` and in `pool.snapshot()`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional, Union

import torch

from ._runtime import _get_device_index, _lazy_init, _native, is_initialized

_DeviceLike = Union[torch.device, str, int, None]

_NO_CUSTOM_ALLOCATOR = (
    "supa-emu does not load custom allocator shared libraries: every SUPA allocation is served "
    "by the emulator's own caching allocator, whose accounting (memory_stats, capacity, OOM) the "
    "emulation depends on. Remove the custom allocator when running under SUPA_EMULATE=1.")


class _SUPAAllocator:
    """Handle on an allocator as `change_current_allocator` expects it."""

    def __init__(self, allocator: Any) -> None:
        self._allocator = allocator

    def allocator(self) -> Any:
        return self._allocator


class SUPAPluggableAllocator(_SUPAAllocator):
    """A custom allocator loaded from a shared library. Not available in the emulator.

    Raises NotImplementedError (a RuntimeError) on construction.
    """

    def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
        raise NotImplementedError(f"SUPAPluggableAllocator({path_to_so_file!r}): {_NO_CUSTOM_ALLOCATOR}")


def change_current_allocator(allocator: _SUPAAllocator) -> None:
    """Swap the device allocator. Not available in the emulator: raises NotImplementedError."""
    raise NotImplementedError(f"change_current_allocator: {_NO_CUSTOM_ALLOCATOR}")


def _get_current_allocator() -> _SUPAAllocator:
    """The active allocator (always the emulator's caching allocator)."""
    return _SUPAAllocator(None)


# Pool objects by id, so that the core's active pool id maps back to its MemPool. The use count
# and the active pool themselves live in the core (mem_pool.cpp).
_pools: "weakref.WeakValueDictionary[tuple[int, int], MemPool]" = weakref.WeakValueDictionary()


class MemPool:
    """A private memory pool: allocations made under `use_mem_pool(pool)` come from it.

    As on a card, the pool keeps its cached blocks while it lives (`empty_cache()` leaves them);
    with `use_on_oom=True` a request that would otherwise run out of memory may take them back;
    with `no_split=True` its blocks are never split: each allocation keeps a whole segment.
    """

    def __init__(self, allocator: Optional[_SUPAAllocator] = None, use_on_oom: bool = False,
                 no_split: bool = False) -> None:
        _lazy_init()
        if allocator is not None and allocator.allocator() is not None:
            raise NotImplementedError(f"MemPool(allocator=...): {_NO_CUSTOM_ALLOCATOR}")
        self._id: tuple[int, int] = tuple(_native()._mem_pool_id())
        _native()._retain_pool(self._id)
        _native()._set_pool_rules(self._id, bool(use_on_oom), bool(no_split))
        _pools[self._id] = self
        self._allocator = allocator
        self.use_on_oom = use_on_oom
        self.no_split = no_split

    @property
    def id(self) -> tuple[int, int]:
        """The pool's (graph id, user id) pair; user pools are (0, n)."""
        return self._id

    @property
    def allocator(self) -> Optional[_SUPAAllocator]:
        """The allocator this pool was created with (None: the default one)."""
        return self._allocator

    def use_count(self) -> int:
        """How many holders reference the pool: 1 for the pool itself, +1 per active `use_mem_pool`."""
        return int(_native()._pool_use_count(self._id))

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments that belong to this pool (live blocks and the pool's cached free blocks)."""
        from ._memory_history import memory_snapshot

        return memory_snapshot(self._id)

    def __del__(self) -> None:
        # The pool's cached blocks serve no other request: give them back with the pool.
        if is_initialized() and hasattr(self, "_id"):
            try:
                if _native()._release_pool(self._id) == 0:
                    _native()._release_pool_cache(self._id)
            except Exception:  # interpreter shutdown: the core may already be gone
                pass


class MemPoolContext:
    """Makes `pool` the active pool (`active_pool()`) from construction until `__exit__`.

    Only `use_mem_pool` routes allocations; this object sets which pool is active.
    """

    def __init__(self, pool: MemPool) -> None:
        self._pool = pool  # keeps the pool alive while it is active
        self._prev = tuple(_native()._exchange_active_pool(pool.id))
        self._active = True

    def __enter__(self) -> "MemPoolContext":
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        self._restore()
        return False

    def __del__(self) -> None:
        self._restore()

    def _restore(self) -> None:
        if getattr(self, "_active", False):
            self._active = False
            _native()._exchange_active_pool(self._prev)

    @staticmethod
    def active_pool() -> Optional[MemPool]:
        """The pool currently active in this thread, or None."""
        if not is_initialized():
            return None
        return _pools.get(tuple(_native()._active_pool()))


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: _DeviceLike = None) -> Iterator[None]:
    """Route this thread's allocations on `device` (default: current) to `pool` within the block."""
    idx = _get_device_index(device, optional=True)
    ctx = MemPoolContext(pool)
    _native()._retain_pool(pool.id)
    _native()._begin_allocate_to_pool(idx, pool.id)
    try:
        yield
    finally:
        _native()._end_allocate_to_pool(idx, pool.id)
        _native()._release_pool(pool.id)
        ctx._restore()


# The pool entry points of the real `torch_supa._C` (torch._C._cuda_* on CUDA), which CUDA-graph
# tooling (Inductor's graph trees) calls to allocate into a graph's pool outside a capture.

def _begin_allocate_current_thread_to_pool(device: int, pool: tuple[int, int]) -> None:
    """This thread's allocations on `device` (on any stream) go to `pool` until
    `_end_allocate_to_pool`; holds the pool (a use, given back by `_release_pool`)."""
    _lazy_init()
    _native()._retain_pool(tuple(pool))
    _native()._begin_allocate_to_pool(device, tuple(pool))


def _end_allocate_to_pool(device: int, pool: tuple[int, int]) -> None:
    """Ends `_begin_allocate_current_thread_to_pool`; the pool stays held until `_release_pool`."""
    _native()._end_allocate_to_pool(device, tuple(pool))


def _release_pool(device: int, pool: tuple[int, int]) -> None:
    """Gives back a use of `pool`; once none is left, `empty_cache()` returns its free segments."""
    _native()._release_pool(tuple(pool))


def _check_pool_live_allocations(device: int, pool: tuple[int, int], live_data_ptrs: Any) -> bool:
    """Whether the allocated blocks of `pool` on `device` are exactly those at `live_data_ptrs`."""
    from ._memory_history import memory_snapshot

    allocated = {block["address"] for segment in memory_snapshot() if segment["device"] == device
                 and tuple(segment["segment_pool_id"]) == tuple(pool)
                 for block in segment["blocks"] if block["state"] == "active_allocated"}
    return allocated == set(live_data_ptrs)
