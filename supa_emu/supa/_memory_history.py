"""Memory snapshots and allocation history: `_record_memory_history`, `_snapshot`, `_set_memory_metadata`.

The core records the history (memory_history.cpp): each allocation and free, with the Python
stack that made it, in the layout of `torch.cuda.memory._snapshot()`, so PyTorch's memory
visualiser and `torch.cuda._memory_viz` read a dumped snapshot unchanged.
"""

from __future__ import annotations

import inspect
import pickle
import sys
from typing import Any, Optional, Union

import torch
from torch._utils import _augment_memory_snapshot_stack_traces

from ._runtime import _get_device_index, _lazy_init, _native, device_count

_DeviceLike = Union[torch.device, str, int, None]


# What the allocator records (segment_map, segment_unmap: expandable segments); the one a card's
# allocator has and the emulator's never records (snapshot) may still be skipped.
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
            "segment_unmap", "oom", "snapshot")
# torch.cuda's context levels, as the core numbers them (memory_history.h, StackContext).
_CONTEXT_LEVELS = {None: 0, "state": 1, "alloc": 2, "all": 3}


def _record_memory_history(enabled: Any = "all", *args: Any, **kwargs: Any) -> None:
    """Turn allocation-history recording on or off.

    Takes torch.cuda's arguments (`_record_memory_history_impl`'s signature below), or the legacy
    form whose first argument is a bool. With `enabled="all"`, `_snapshot()["device_traces"]` lists
    every allocation and free (at most `max_entries`, the newest); with "state", only the newest
    event, and live blocks keep the stack that allocated them (each block's "frames").

    `context` says which stacks are kept: "state" those of live blocks only, "alloc" also those of
    the trace's allocations (a free then shows the stack of what it frees), "all" also the stacks
    of the frees (empty_cache's for the segments it gives back); None none. `stacks="all"` adds C++
    frames to the Python ones. `clear_history` drops the trace recorded so far (turning recording
    off always does); `skip_actions` lists actions left out of the trace (ValueError for an unknown
    one); `compile_context` names, in each event's "compile_context", the Torch-Compiled Region it
    ran in ("N/A" outside one). The record_function ranges the calling thread enters and leaves
    (every thread's with `global_record_annotations`) are kept as the snapshot's
    "external_annotations". History is process-wide: `device` is validated, and every device is
    recorded.
    """
    if isinstance(enabled, bool):
        _record_memory_history_legacy(enabled, *args, **kwargs)
    else:
        _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_legacy(enabled: bool, record_context: bool = True,
                                  trace_alloc_max_entries: int = 1, trace_alloc_record_context: bool = False,
                                  device: _DeviceLike = None, record_context_cpp: bool = False,
                                  clear_history: bool = False, compile_context: bool = False,
                                  global_record_annotations: bool = False,
                                  skip_actions: Optional[list[str]] = None) -> None:
    context = "alloc" if trace_alloc_record_context else "state" if record_context else None
    _apply(enabled, context if enabled else None, bool(record_context_cpp), max(1, trace_alloc_max_entries),
           device, clear_history, compile_context, global_record_annotations, skip_actions)


def _record_memory_history_impl(enabled: Optional[str] = "all", context: Optional[str] = "all",
                                stacks: str = "all", max_entries: int = sys.maxsize,
                                device: _DeviceLike = None, clear_history: bool = False,
                                compile_context: bool = False, global_record_annotations: bool = False,
                                skip_actions: Optional[list[str]] = None) -> None:
    if enabled not in (None, "state", "all"):
        raise ValueError(f"enabled must be None, 'state' or 'all', got {enabled!r}")
    if context not in _CONTEXT_LEVELS:
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', got {context!r}")
    if stacks not in ("python", "all"):
        raise ValueError(f"stacks must be 'python' or 'all', got {stacks!r}")
    if not isinstance(max_entries, int) or max_entries < 0:
        raise ValueError(f"max_entries must be a non-negative int, got {max_entries!r}")
    _apply(enabled is not None, context if enabled is not None else None, stacks == "all",
           max_entries if enabled == "all" else 1, device, clear_history, compile_context,
           global_record_annotations, skip_actions)


_record_memory_history.__signature__ = inspect.signature(_record_memory_history_impl)  # type: ignore[attr-defined]


def _apply(recording: bool, context: Optional[str], cpp_stacks: bool, max_entries: int, device: _DeviceLike,
           clear_history: bool, compile_context: bool, global_record_annotations: bool,
           skip_actions: Optional[list[str]]) -> None:
    skip = list(skip_actions or ())
    unknown = [action for action in skip if action not in _ACTIONS]
    if unknown:
        raise ValueError(f"skip_actions: unknown action {unknown[0]!r}; the actions are {', '.join(_ACTIONS)}")
    _get_device_index(device, optional=True)
    _lazy_init()
    _native()._set_memory_history(
        recording=recording, context=_CONTEXT_LEVELS[context], cpp_stacks=cpp_stacks and context is not None,
        max_entries=max_entries, clear=bool(clear_history), compile_context=bool(compile_context),
        global_annotations=bool(global_record_annotations), skip_actions=skip)


def _set_memory_metadata(metadata: str) -> None:
    """Attach `metadata` to every allocator event recorded from now on (each trace entry's
    "user_metadata"); an empty string clears it."""
    _native()._set_memory_metadata(str(metadata))


def _get_memory_metadata() -> str:
    """The string `_set_memory_metadata` set; "" when none is."""
    return _native()._memory_metadata()


def memory_snapshot(mempool_id: Optional[tuple[int, int]] = None, include_traces: bool = True) -> list[dict[str, Any]]:
    """The allocator's segments across all devices, each with its blocks (see `_snapshot`).

    With `mempool_id` (a `MemPool.id`), only the segments of that pool. `include_traces` is
    torch.cuda's switch for the allocator's trace, which this list never holds.
    """
    segments = _native()._memory_snapshot()
    if mempool_id is None:
        return list(segments)
    pool = tuple(mempool_id)
    return [segment for segment in segments if tuple(segment["segment_pool_id"]) == pool]


def _snapshot(device: _DeviceLike = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
    """Full allocator state: {"segments", "device_traces", "allocator_settings", "external_annotations"}.

    As torch.cuda's, the snapshot covers every device (each segment names its "device");
    a `device` given is only checked to be a valid one (ValueError / AssertionError otherwise;
    an index-less supa device is the current one).

    "device_traces" holds one list per device of the events recorded since
    `_record_memory_history` turned tracing on ({"action", "addr", "size", "stream", "time_us",
    "frames", "compile_context", "user_metadata"}); "external_annotations" the record_function
    ranges entered and left meanwhile ({"name", "stage", "device", "time_us"}, stage START or END).

    With `augment_with_fx_traces`, frames in code that torch.fx generated name the graph node they
    ran and its original source (torch._utils._augment_memory_snapshot_stack_traces, as
    torch.cuda's).
    """
    from ._allocator_config import allocator_settings_in_effect

    if device is not None and not 0 <= _get_device_index(device, optional=True) < device_count():
        raise AssertionError("Invalid device id")
    snapshot = {
        "segments": memory_snapshot(),
        "device_traces": list(_native()._memory_trace()),
        "allocator_settings": allocator_settings_in_effect(),
        "external_annotations": list(_native()._memory_annotations()),
    }
    if augment_with_fx_traces:
        snapshot = _augment_memory_snapshot_stack_traces(snapshot)
    return snapshot


def _dump_snapshot(filename: str = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """Pickle `_snapshot(augment_with_fx_traces=...)` to `filename` (readable by PyTorch's memory
    visualiser)."""
    snapshot = _snapshot(augment_with_fx_traces=augment_with_fx_traces)
    with open(filename, "wb") as f:
        pickle.dump(snapshot, f)
