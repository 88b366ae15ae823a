"""Memory management of SUPA devices: statistics, caching-allocator control, pools, snapshots.

Counters come from the emulator's device allocator through PyTorch's generic accelerator
entry points (`torch._C._accelerator_*`), so `torch.supa.memory_stats()` and
`torch.accelerator.memory_stats("supa")` always agree.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import pickle
import sys
import threading
import warnings
from typing import Any, Iterator, Optional, Union

import torch
from typing_extensions import deprecated

from . import _get_device_index, _lazy_init, _native, current_device, device_count, is_initialized
from . import device as _device_ctx
from . import supart

_DeviceLike = Union[torch.device, str, int, None]

__all__ = [
    "_record_memory_history", "_snapshot",
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_enable",
    "get_per_process_memory_fraction", "set_per_process_memory_fraction", "empty_cache",
    "ipc_collect", "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_cached", "max_memory_cached", "memory_snapshot", "memory_summary", "mem_get_info",
    "_set_allocator_settings", "get_allocator_backend", "change_current_allocator", "MemPool",
    "MemPoolContext", "use_mem_pool", "SUPAPluggableAllocator",
]

_NO_CUSTOM_ALLOCATOR = (
    "supa-emu does not load custom allocator shared libraries: every SUPA allocation is served "
    "by the emulator's own caching allocator, whose accounting (memory_stats, capacity, OOM) the "
    "emulation depends on. Remove the custom allocator when running under SUPA_EMULATE=1.")


# ---------------------------------------------------------------------------------------------
# Raw allocation through the caching allocator.

def caching_allocator_alloc(size: int, device: _DeviceLike = None, stream: Any = None) -> int:
    """Allocate `size` bytes on `device` (default: current) and return the address as an int.

    `stream` may be a `torch.supa.Stream` or an int stream handle (default: the current stream).
    Raises TypeError for any other stream type, torch.OutOfMemoryError when the card is full.
    """
    from .streams import Stream, current_stream

    if device is None:
        device = current_device()
    idx = _get_device_index(device)
    if stream is None:
        stream = current_stream(idx)
    if isinstance(stream, Stream):
        stream = stream.supa_stream
    if not isinstance(stream, int):
        raise TypeError(
            "Invalid type for stream argument, must be `torch.supa.Stream` or `int` representing a "
            "pointer to a existing stream")
    with _device_ctx(idx):
        return int(_native()._raw_alloc(int(size), idx))


def caching_allocator_delete(mem_ptr: int) -> None:
    """Free memory obtained from `caching_allocator_alloc` (it returns to the cache)."""
    _native()._raw_delete(int(mem_ptr))


_caching_enabled = True


def caching_allocator_enable(value: bool = True) -> None:
    """Record whether caching is wanted; has an effect only once the runtime is initialised.

    The emulator's allocator always caches (its statistics describe a caching allocator), so
    disabling is accepted but does not change allocation behaviour.
    """
    global _caching_enabled
    if is_initialized():
        _caching_enabled = bool(value)


# ---------------------------------------------------------------------------------------------
# Capacity limits and cache control.

def set_per_process_memory_fraction(fraction: float, device: _DeviceLike = None) -> None:
    """Cap this process's allocations on `device` at `fraction` of its capacity.

    Raises TypeError unless `fraction` is a float (ints are rejected) and ValueError outside
    [0, 1]. Allocations beyond the cap raise torch.OutOfMemoryError.
    """
    _lazy_init()
    if device is None:
        device = current_device()
    idx = _get_device_index(device)
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    _native()._set_memory_fraction(fraction, idx)


def get_per_process_memory_fraction(device: _DeviceLike = None) -> float:
    """The cap set by `set_per_process_memory_fraction` for `device`; 1.0 until one is set."""
    _lazy_init()
    if device is None:
        device = current_device()
    return float(_native()._get_memory_fraction(_get_device_index(device)))


def empty_cache() -> None:
    """Return unused cached blocks to the device so they leave `memory_reserved()`.

    Does nothing before the runtime is initialised. Memory held by live tensors stays allocated.
    """
    if is_initialized():
        torch._C._accelerator_emptyCache()


def ipc_collect() -> None:
    """Release memory kept for tensors shared with other processes. The emulator shares none."""
    _lazy_init()


def mem_get_info(device: _DeviceLike = None) -> tuple[int, int]:
    """(free, total) bytes of `device` (default: current), as the runtime reports them."""
    if device is None:
        device = current_device()
    return supart().supaMemGetInfo(_get_device_index(device))


# ---------------------------------------------------------------------------------------------
# Statistics.

def memory_stats_as_nested_dict(device: _DeviceLike = None) -> dict[str, Any]:
    """The allocator's statistics as a nested dict; `{}` before the runtime is initialised."""
    if not is_initialized():
        return {}
    idx = _get_device_index(device, optional=True)
    return torch._C._accelerator_getDeviceStats(idx)


def memory_stats(device: _DeviceLike = None) -> "collections.OrderedDict[str, Any]":
    """The allocator's statistics flattened to dotted keys, sorted by key.

    Keys look like "allocated_bytes.all.current", "segment.large_pool.peak" or "num_ooms".
    Empty before the runtime is initialised.
    """
    flat: list[tuple[str, Any]] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else key, value)
        else:
            flat.append((prefix, node))

    walk("", memory_stats_as_nested_dict(device))
    flat.sort(key=lambda kv: kv[0])
    return collections.OrderedDict(flat)


def reset_accumulated_memory_stats(device: _DeviceLike = None) -> None:
    """Zero the cumulative counters (`*.allocated`, `*.freed`, retries, OOMs)."""
    torch._C._accelerator_resetAccumulatedStats(_get_device_index(device, optional=True))


def reset_peak_memory_stats(device: _DeviceLike = None) -> None:
    """Set every `*.peak` statistic to its current value."""
    torch._C._accelerator_resetPeakStats(_get_device_index(device, optional=True))


def reset_max_memory_allocated(device: _DeviceLike = None) -> None:
    """Deprecated spelling of `reset_peak_memory_stats` (warns: it resets all peaks)."""
    warnings.warn(
        "torch.supa.reset_max_memory_allocated now calls torch.supa.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.", FutureWarning)
    reset_peak_memory_stats(device)


def reset_max_memory_cached(device: _DeviceLike = None) -> None:
    """Deprecated spelling of `reset_peak_memory_stats` (warns: it resets all peaks)."""
    warnings.warn(
        "torch.supa.reset_max_memory_cached now calls torch.supa.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.", FutureWarning)
    reset_peak_memory_stats(device)


def memory_allocated(device: _DeviceLike = None) -> int:
    """Bytes currently occupied by tensors on `device` (block sizes after rounding); 0 before init."""
    return memory_stats(device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device: _DeviceLike = None) -> int:
    """Peak of `memory_allocated` since start or the last `reset_peak_memory_stats`."""
    return memory_stats(device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device: _DeviceLike = None) -> int:
    """Bytes held by the caching allocator on `device` (allocated plus cached); 0 before init."""
    return memory_stats(device).get("reserved_bytes.all.current", 0)


def max_memory_reserved(device: _DeviceLike = None) -> int:
    """Peak of `memory_reserved` since start or the last `reset_peak_memory_stats`."""
    return memory_stats(device).get("reserved_bytes.all.peak", 0)


@deprecated("`torch.supa.memory_cached` has been renamed to `torch.supa.memory_reserved`",
            category=FutureWarning)
def memory_cached(device: _DeviceLike = None) -> int:
    """Deprecated name of `memory_reserved`."""
    return memory_reserved(device)


@deprecated("`torch.supa.max_memory_cached` has been renamed to `torch.supa.max_memory_reserved`",
            category=FutureWarning)
def max_memory_cached(device: _DeviceLike = None) -> int:
    """Deprecated name of `max_memory_reserved`."""
    return max_memory_reserved(device)


# ---------------------------------------------------------------------------------------------
# Human-readable summary.

_RULE_WIDTH = 75
_SIZE_METRICS = (
    ("allocated_bytes", "Allocated memory"),
    ("active_bytes", "Active memory"),
    ("requested_bytes", "Requested memory"),
    ("reserved_bytes", "GPU reserved memory"),
    ("inactive_split_bytes", "Non-releasable memory"),
)
_COUNT_METRICS = (
    ("allocation", "Allocations"),
    ("active", "Active allocs"),
    ("segment", "GPU reserved segments"),
    ("inactive_split", "Non-releasable allocs"),
)
_OVERSIZE_METRICS = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize GPU segments"),
)
_STAT_COLUMNS = ("current", "peak", "allocated", "freed")


def _scaled(value: int, reference: float, units: tuple[str, ...], step: int, threshold: int) -> tuple[int, str]:
    # Each cell picks the largest unit that keeps `reference` readable (values are
    # integer-divided), which also keeps every cell within the column width.
    unit = units[0]
    for bigger in units[1:]:
        if reference < threshold:
            break
        unit = bigger
        value //= step
        reference /= step
    return value, unit


def _format_size(value: int, reference: int) -> str:
    value, unit = _scaled(value, reference, ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB"), 1024, 768 * 1024)
    return f"{value:6d} {unit}"


def _format_count(value: int, reference: int) -> str:
    value, unit = _scaled(value, reference, (" ", "K", "M"), 1000, 750 * 1000)
    return f"{value:7d} {unit} "


def _table_row(label: str, cells: list[str]) -> str:
    return f" {label:<21} | " + " | ".join(cells) + " "


def memory_summary(device: _DeviceLike = None, abbreviated: bool = False) -> str:
    """A printable table of the allocator statistics of `device` (default: current).

    With `abbreviated`, only the "all" rows are shown (no large/small pool breakdown).
    Raises KeyError before the runtime is initialised, when there are no statistics yet.
    """
    idx = _get_device_index(device, optional=True)
    stats = memory_stats(idx)
    thick, thin = "=" * _RULE_WIDTH, "-" * _RULE_WIDTH
    title = f"PyTorch SUPA memory summary, device ID {idx}"
    ooms = f"SUPA OOMs: {stats['num_ooms']}"
    retries = f"supaMalloc retries: {stats['num_alloc_retries']}"
    lines = [
        thick,
        f"{title:^{_RULE_WIDTH}}",
        thin,
        f"{ooms:^37}|{retries:^37}",
        thick,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    pools = (("all", None),) if abbreviated else (
        ("all", None), ("large_pool", "      from large pool"), ("small_pool", "      from small pool"))

    def add_metric(key: str, title: str, fmt) -> None:
        lines.append(thin)
        for pool, sub_label in pools:
            values = [stats[f"{key}.{pool}.{col}"] for col in _STAT_COLUMNS]
            lines.append(_table_row(sub_label or title, [fmt(v, v) for v in values]))

    for key, title in _SIZE_METRICS:
        add_metric(key, title, _format_size)
    for key, title in _COUNT_METRICS:
        add_metric(key, title, _format_count)
    for key, title in _OVERSIZE_METRICS:
        lines.append(thin)
        values = [stats[f"{key}.{col}"] for col in _STAT_COLUMNS]
        lines.append(_table_row(title, [_format_count(v, v) for v in values]))
    lines.append(thick)
    return "|" + "|\n|".join(lines) + "|\n"


# ---------------------------------------------------------------------------------------------
# Snapshots and allocation history.

_history: dict[str, Any] = {"enabled": None, "context": None, "stacks": "all", "max_entries": 0}
_allocator_settings: dict[str, Any] = {
    "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": False,
    "pinned_num_register_threads": 1, "release_lock_on_supamalloc": False,
    "pinned_use_supa_host_register": False,
}
# Accepted PYTORCH_SUPA_ALLOC_CONF keys -> (settings key, parser). CUDA spellings are accepted
# too because code written for torch.cuda passes them through unchanged.
_SETTING_PARSERS = {
    "max_split_size_mb": ("max_split_size", lambda v: int(v) << 20),
    "garbage_collection_threshold": ("garbage_collection_threshold", float),
    "expandable_segments": ("expandable_segments", lambda v: _parse_bool(v)),
    "pinned_num_register_threads": ("pinned_num_register_threads", int),
    "release_lock_on_supamalloc": ("release_lock_on_supamalloc", lambda v: _parse_bool(v)),
    "release_lock_on_cudamalloc": ("release_lock_on_supamalloc", lambda v: _parse_bool(v)),
    "pinned_use_supa_host_register": ("pinned_use_supa_host_register", lambda v: _parse_bool(v)),
    "pinned_use_cuda_host_register": ("pinned_use_supa_host_register", lambda v: _parse_bool(v)),
    "pinned_reserve_segment_size_mb": ("pinned_reserve_segment_size_mb", int),
    "pinned_use_background_threads": ("pinned_use_background_threads", lambda v: _parse_bool(v)),
    "roundup_power2_divisions": ("roundup_power2_divisions", str),
    "backend": ("backend", str),
}


def _parse_bool(value: str) -> bool:
    if value in ("True", "true", "1"):
        return True
    if value in ("False", "false", "0"):
        return False
    raise RuntimeError(f"Expected True or False in SUPA allocator config, got {value!r}")


def _set_allocator_settings(env: str) -> None:
    """Apply a PYTORCH_SUPA_ALLOC_CONF-style string ("key:value,key:value") at runtime.

    Raises RuntimeError for unknown keys or malformed values. The emulator records the settings
    (they appear in `_snapshot()["allocator_settings"]`); its allocator layout is fixed.
    """
    for item in filter(None, (part.strip() for part in env.split(","))):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key not in _SETTING_PARSERS or not sep:
            raise RuntimeError(f"Unrecognized or malformed entry {item!r} in SUPA allocator config; "
                               f"known keys: {', '.join(sorted(_SETTING_PARSERS))}")
        name, parse = _SETTING_PARSERS[key]
        try:
            _allocator_settings[name] = parse(value)
        except ValueError as exc:
            raise RuntimeError(f"Invalid value {value!r} for {key} in SUPA allocator config") from exc


def get_allocator_backend() -> str:
    """Name of the active allocator backend: always 'native' (the caching allocator)."""
    return "native"


def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """Turn allocation-history recording on or off (settings show up in `_snapshot()`).

    Accepts the current form `(enabled="all"|"state"|None, context=..., stacks=..., max_entries=...,
    device=None)` and the legacy form whose first argument is a bool. The emulator keeps no
    per-allocation trace, so `device_traces` stay empty.
    """
    if isinstance(enabled, bool):
        _record_memory_history_legacy(enabled, *args, **kwargs)
    else:
        _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_legacy(enabled: bool, record_context: bool = True,
                                  trace_alloc_max_entries: int = 1, trace_alloc_record_context: bool = False,
                                  device: _DeviceLike = None, record_context_cpp: bool = False) -> None:
    _history.update(enabled="all" if enabled else None,
                    context="all" if (enabled and trace_alloc_record_context) else ("state" if enabled and record_context else None),
                    stacks="all" if record_context_cpp else "python",
                    max_entries=trace_alloc_max_entries if enabled else 0)


def _record_memory_history_impl(enabled: Optional[str] = "all", context: Optional[str] = "all",
                                stacks: str = "all", max_entries: int = sys.maxsize,
                                device: _DeviceLike = None) -> None:
    if enabled not in (None, "state", "all"):
        raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
    if context not in (None, "state", "alloc", "all"):
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
    if stacks not in ("python", "all"):
        raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
    _history.update(enabled=enabled, context=context, stacks=stacks,
                    max_entries=max_entries if enabled else 0)


def memory_snapshot() -> list[dict[str, Any]]:
    """The allocator's segments across all devices, each with its blocks (see `_snapshot`)."""
    return list(_native()._memory_snapshot())


def _snapshot(device: _DeviceLike = None) -> dict[str, Any]:
    """Full allocator state: {"segments", "device_traces", "allocator_settings"}."""
    return {
        "segments": memory_snapshot(),
        "device_traces": [[] for _ in range(device_count())],
        "allocator_settings": dict(_allocator_settings),
    }


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """Pickle `_snapshot()` to `filename` (readable by PyTorch's memory visualiser)."""
    with open(filename, "wb") as f:
        pickle.dump(_snapshot(), f)


# ---------------------------------------------------------------------------------------------
# Allocators and memory pools.

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


# User pools get ids (0, n) and graph pools (n, 0), as the caching allocator numbers them.
_user_pool_ids = itertools.count(1)
_pool_lock = threading.Lock()
_pool_state = threading.local()


class MemPool:
    """A private memory pool: an id that groups allocations made under `use_mem_pool`.

    The emulator tracks pool identity and use counts; allocations are still served (and
    counted) by the device's general caching allocator.
    """

    def __init__(self, allocator: Optional[_SUPAAllocator] = None, use_on_oom: bool = False,
                 no_split: bool = False) -> None:
        _lazy_init()
        if allocator is not None and allocator.allocator() is not None:
            raise NotImplementedError(f"MemPool(allocator=...): {_NO_CUSTOM_ALLOCATOR}")
        with _pool_lock:
            self._id = (0, next(_user_pool_ids))
        self._allocator = allocator
        self._use_count = 1
        self.use_on_oom = use_on_oom
        self.no_split = no_split

    @property
    def id(self) -> tuple[int, int]:
        """The pool's (graph id, user id) pair."""
        return self._id

    @property
    def allocator(self) -> Optional[_SUPAAllocator]:
        """The allocator this pool was created with (None: the default one)."""
        return self._allocator

    def use_count(self) -> int:
        """How many holders reference the pool: 1 for the pool itself, +1 per active `use_mem_pool`."""
        return self._use_count

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments that belong to this pool."""
        return [seg for seg in memory_snapshot() if tuple(seg.get("segment_pool_id", (0, 0))) == self._id]


class MemPoolContext:
    """Makes `pool` the active pool from construction until `__exit__` (or deletion)."""

    def __init__(self, pool: MemPool) -> None:
        self._pool = pool
        self._prev = MemPoolContext.active_pool()
        self._active = True
        _pool_state.active = pool

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
            _pool_state.active = self._prev

    @staticmethod
    def active_pool() -> Optional[MemPool]:
        """The pool currently receiving allocations in this thread, or None."""
        return getattr(_pool_state, "active", None)


@contextlib.contextmanager
def use_mem_pool(pool: MemPool, device: _DeviceLike = None) -> Iterator[None]:
    """Route allocations on `device` (default: current) to `pool` within the block."""
    _get_device_index(device, optional=True)  # validates the device argument
    ctx = MemPoolContext(pool)
    pool._use_count += 1
    try:
        yield
    finally:
        pool._use_count -= 1
        ctx._restore()
