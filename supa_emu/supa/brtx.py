"""Biren tools extension ranges (`torch.supa.brtx`), the analogue of NVTX.

Ranges and marks become `torch.profiler.record_function` regions, so they show up as named
spans in a torch.profiler trace. Push/pop ranges nest per thread; start/end ranges may overlap
and are identified by the id `range_start` returns.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator

from torch.autograd.profiler import record_function

__all__ = ["range_push", "range_pop", "range_start", "range_end", "mark", "range"]

_local = threading.local()
_open_ranges: dict[int, record_function] = {}
_range_ids = itertools.count(1)
_lock = threading.Lock()


def _stack() -> list[record_function]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def range_push(msg: str) -> int:
    """Open a nested range named `msg`; returns its zero-based nesting depth."""
    region = record_function(msg)
    region.__enter__()
    stack = _stack()
    stack.append(region)
    return len(stack) - 1


def range_pop() -> int:
    """Close the innermost range of this thread; returns its depth, or -1 if none was open."""
    stack = _stack()
    if not stack:
        return -1
    stack.pop().__exit__(None, None, None)
    return len(stack)


def range_start(msg: str) -> int:
    """Open a range that may overlap others; returns the id to pass to `range_end`."""
    region = record_function(msg)
    region.__enter__()
    with _lock:
        range_id = next(_range_ids)
        _open_ranges[range_id] = region
    return range_id


def range_end(range_id: int) -> None:
    """Close the range `range_start` returned `range_id` for (unknown ids are ignored)."""
    with _lock:
        region = _open_ranges.pop(range_id, None)
    if region is not None:
        region.__exit__(None, None, None)


def mark(msg: str) -> None:
    """Record an instantaneous event named `msg`."""
    with record_function(msg):
        pass


@contextlib.contextmanager
def range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
    """Context manager around a nested range; `msg` is formatted with `args`/`kwargs`."""
    range_push(msg.format(*args, **kwargs))
    try:
        yield
    finally:
        range_pop()


def _device_range_start(msg: str, stream: int = 0) -> int:
    """Open a range attributed to a device stream; returns its handle. Work is synchronous on the
    host in the emulator, so this is a host range."""
    return range_start(msg)


def _device_range_end(range_handle: int, stream: int = 0) -> None:
    """Close a range opened by `_device_range_start`."""
    range_end(range_handle)
