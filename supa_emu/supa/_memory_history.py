"""Memory snapshots and allocation history: `_record_memory_history`, `_snapshot`, `_dump_snapshot`.

The core records the history (memory_history.cpp): each allocation and free, with the Python
stack that made it, in the layout of `torch.cuda.memory._snapshot()`, so PyTorch's memory
visualiser and `torch.cuda._memory_viz` read a dumped snapshot unchanged.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Optional, Union

import torch

from ._runtime import _get_device_index, _lazy_init, _native, device_count

_DeviceLike = Union[torch.device, str, int, None]


def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """Turn allocation-history recording on or off.

    Accepts the current form `(enabled="all"|"state"|None, context=..., stacks=..., max_entries=...,
    device=None)` and the legacy form whose first argument is a bool. With `enabled="all"`,
    `_snapshot()["device_traces"]` lists every allocation and free (at most `max_entries`, the
    newest); with "state", only the stacks of live blocks are kept (in each block's "frames").
    `context=None` records no stacks; `stacks="all"` adds C++ frames to the Python ones.
    History is process-wide: `device` is validated, and every device is recorded.
    """
    if isinstance(enabled, bool):
        _record_memory_history_legacy(enabled, *args, **kwargs)
    else:
        _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_legacy(enabled: bool, record_context: bool = True,
                                  trace_alloc_max_entries: int = 1, trace_alloc_record_context: bool = False,
                                  device: _DeviceLike = None, record_context_cpp: bool = False) -> None:
    _get_device_index(device, optional=True)
    _lazy_init()
    trace = enabled and trace_alloc_max_entries > 1
    _native()._set_memory_history(
        trace=trace, stacks=bool(enabled and (record_context or trace_alloc_record_context)),
        cpp_stacks=bool(enabled and record_context_cpp),
        max_entries=trace_alloc_max_entries if trace else 0)


def _record_memory_history_impl(enabled: Optional[str] = "all", context: Optional[str] = "all",
                                stacks: str = "all", max_entries: int = sys.maxsize,
                                device: _DeviceLike = None) -> None:
    if enabled not in (None, "state", "all"):
        raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
    if context not in (None, "state", "alloc", "all"):
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
    if stacks not in ("python", "all"):
        raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
    if not isinstance(max_entries, int) or max_entries < 0:
        raise ValueError(f"max_entries must be a non-negative int, got {max_entries!r}")
    _get_device_index(device, optional=True)
    _lazy_init()
    _native()._set_memory_history(
        trace=enabled == "all", stacks=enabled is not None and context is not None,
        cpp_stacks=enabled is not None and context is not None and stacks == "all",
        max_entries=max_entries if enabled == "all" else 0)


def memory_snapshot() -> list[dict[str, Any]]:
    """The allocator's segments across all devices, each with its blocks (see `_snapshot`)."""
    return list(_native()._memory_snapshot())


def _snapshot(device: _DeviceLike = None) -> dict[str, Any]:
    """Full allocator state: {"segments", "device_traces", "allocator_settings"}.

    As torch.cuda's, the snapshot covers every device (each segment names its "device");
    a `device` given is only checked to be a valid one (ValueError / AssertionError otherwise;
    an index-less supa device is the current one).

    "device_traces" holds one list per device of the events recorded since
    `_record_memory_history` turned tracing on ({"action", "addr", "size", "stream", "time_us",
    "frames"}).
    """
    from ._allocator_config import allocator_settings_in_effect

    if device is not None and not 0 <= _get_device_index(device, optional=True) < device_count():
        raise AssertionError("Invalid device id")
    return {
        "segments": memory_snapshot(),
        "device_traces": list(_native()._memory_trace()),
        "allocator_settings": allocator_settings_in_effect(),
    }


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """Pickle `_snapshot()` to `filename` (readable by PyTorch's memory visualiser)."""
    with open(filename, "wb") as f:
        pickle.dump(_snapshot(), f)
