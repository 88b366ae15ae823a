"""Memory management of SUPA devices: statistics, caching-allocator control, limits, summary.

Counters come from the emulator's device allocator through PyTorch's generic accelerator
entry points (`torch._C._accelerator_*`), so `torch.supa.memory_stats()` and
`torch.accelerator.memory_stats("supa")` always agree.
"""

from __future__ import annotations

import collections
import operator
import warnings
from typing import Any, Union

import torch
from typing_extensions import deprecated

from ._runtime import _get_device_index, _lazy_init, _native, current_device, is_initialized
from ._runtime import device as _device_ctx
from ._runtime import supart
# Snapshots and history, allocator settings and pools live in their own modules; their public
# names belong to this module, as in torch.cuda.memory.
from ._allocator_config import _set_allocator_settings, get_allocator_backend
from ._mem_pool import (
    MemPool, MemPoolContext, SUPAPluggableAllocator, _get_current_allocator, _SUPAAllocator,
    change_current_allocator, use_mem_pool)
from ._memory_history import (
    _dump_snapshot, _get_memory_metadata, _record_memory_history, _set_memory_metadata, _snapshot, memory_snapshot)

_DeviceLike = Union[torch.device, str, int, None]

__all__ = [
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_enable",
    "get_per_process_memory_fraction", "set_per_process_memory_fraction", "empty_cache",
    "ipc_collect", "memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_cached", "max_memory_cached", "memory_snapshot", "memory_summary", "mem_get_info",
    "get_allocator_backend", "change_current_allocator", "MemPool",
    "MemPoolContext", "use_mem_pool", "SUPAPluggableAllocator",
]

# ---------------------------------------------------------------------------------------------
# Raw allocation through the caching allocator.

def caching_allocator_alloc(size: int, device: _DeviceLike = None, stream: Any = None) -> int:
    """Allocate `size` bytes on `device` (default: current) and return the address as an int.

    `stream` may be a `torch.supa.Stream` or an int stream handle (default: the current stream).
    Raises TypeError for any other stream type, ValueError for a Stream of another device,
    torch.OutOfMemoryError when the card is full. As on a card, the block belongs to that stream:
    once freed it serves later allocations made on the same stream only.
    """
    from .streams import ExternalStream, Stream, current_stream, stream as stream_context

    if device is None:
        device = current_device()
    idx = _get_device_index(device)
    current = current_stream(idx).supa_stream
    if stream is None:
        stream = current
    if isinstance(stream, Stream):
        if stream.device_index != idx:
            raise ValueError(f"caching_allocator_alloc: the stream is on supa:{stream.device_index}, "
                             f"the allocation on supa:{idx}; pass a stream of supa:{idx}")
        stream = stream.supa_stream
    if not isinstance(stream, int):
        raise TypeError(
            "Invalid type for stream argument, must be `torch.supa.Stream` or `int` representing a "
            "pointer to a existing stream")
    with _device_ctx(idx), stream_context(ExternalStream(stream, device=idx)):
        return int(_native()._raw_alloc(int(size), idx))


def caching_allocator_delete(mem_ptr: int) -> None:
    """Free memory obtained from `caching_allocator_alloc` (it returns to the cache)."""
    _native()._raw_delete(int(mem_ptr))


def caching_allocator_enable(value: bool = True) -> None:
    """Enable or disable the caching allocator.

    The emulator's allocator always caches (its statistics describe a caching allocator), so
    disabling it warns that this is not modelled and changes nothing.
    """
    if not value:
        warnings.warn("torch.supa.caching_allocator_enable(False) is not modelled by the emulator: "
                      "its allocator always caches freed blocks (empty_cache() releases them)",
                      UserWarning, stacklevel=2)


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
    """Free the memory of supa tensors sent to other processes once the sender's tensor and
    every receiver have released it (until then it stays allocated on the sender's device)."""
    _lazy_init()
    _native()._ipc_collect()


def mem_get_info(device: _DeviceLike = None) -> tuple[int, int]:
    """(free, total) bytes of `device` (None or an index-less supa device: the current one), as the
    runtime reports them."""
    return supart().supaMemGetInfo(_get_device_index(device, optional=True))


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
    # A loop, not a recursive walk, and a C key function: DeepSpeed's ZeRO-3 reads the statistics
    # on every step (about 160 nodes), where each Python call would count.
    flat: list[tuple[str, Any]] = []
    pending: list[tuple[str, Any]] = [("", memory_stats_as_nested_dict(device))]
    while pending:
        prefix, node = pending.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                pending.append((f"{prefix}.{key}" if prefix else key, value))
        else:
            flat.append((prefix, node))
    flat.sort(key=operator.itemgetter(0))
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
