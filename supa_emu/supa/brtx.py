"""Biren tools extension ranges (`torch.supa.brtx`), the analogue of NVTX.

Ranges and marks become `torch.profiler.record_function` regions, so they show up as named
spans in a torch.profiler trace. Push/pop ranges nest per thread; start/end ranges may overlap
and are identified by the id `range_start` returns.

Like NVTX and BRTX with no tool attached, a range costs next to nothing while torch's profiler
is not recording (DeepSpeed opens hundreds per training step): it is then only counted, so that
push/pop depths stay right, and a range opened before the profiler starts is not in its trace.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Iterator

from torch._C._autograd import _profiler_enabled
from torch.autograd.profiler import record_function

__all__ = ["range_push", "range_pop", "range_start", "range_end", "mark", "range"]

_local = threading.local()
_open_ranges: dict[int, record_function | None] = {}
_range_ids = itertools.count(1)
_lock = threading.Lock()


def _enter(msg: str) -> record_function | None:
    """A profiler region named `msg`, entered; None while the profiler is off."""
    if not _profiler_enabled():
        return None
    region = record_function(msg)
    region.__enter__()
    return region


def _exit(region: record_function | None) -> None:
    if region is not None:
        region.__exit__(None, None, None)


def _new_stack() -> list[record_function | None]:
    """This thread's range stack, created at its first range."""
    _local.stack = []
    return _local.stack


# range_push and range_pop run hundreds of times per DeepSpeed step (ZeRO-3: about 220 pairs):
# with the profiler off they are one check and a list operation each, without a Python call.
def range_push(msg: str) -> int:
    """Open a nested range named `msg`; returns its zero-based nesting depth."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _new_stack()
    stack.append(_enter(msg) if _profiler_enabled() else None)
    return len(stack) - 1


def range_pop() -> int:
    """Close the innermost range of this thread; returns its depth, or -1 if none was open."""
    stack = getattr(_local, "stack", None)
    if not stack:
        return -1
    region = stack.pop()
    if region is not None:
        _exit(region)
    return len(stack)


def range_start(msg: str) -> int:
    """Open a range that may overlap others; returns the id to pass to `range_end`."""
    region = _enter(msg)
    with _lock:
        range_id = next(_range_ids)
        _open_ranges[range_id] = region
    return range_id


def range_end(range_id: int) -> None:
    """Close the range `range_start` returned `range_id` for (unknown ids are ignored)."""
    with _lock:
        region = _open_ranges.pop(range_id, None)
    _exit(region)


def mark(msg: str) -> None:
    """Record an instantaneous event named `msg`."""
    _exit(_enter(msg))


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
