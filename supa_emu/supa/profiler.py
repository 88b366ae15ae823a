"""Device-profiler switches (`torch.supa.profiler`), the analogue of torch.cuda.profiler.

The emulator has no hardware profiler; `start`/`stop` only flip the runtime's profiler state
so code that brackets a region with them runs unchanged. Use torch.profiler for timings.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _supart
from ._runtime import check_error, supart

__all__ = ["start", "stop", "profile"]

DEFAULT_FLAGS = [
    "gpustarttimestamp",
    "gpuendtimestamp",
    "gridsize3d",
    "threadblocksize",
    "streamid",
    "enableonstart 0",
    "conckerneltrace",
]


def start() -> None:
    """Switch the device profiler on. Raises SupaError if the runtime refuses."""
    check_error(supart().supaProfilerStart())


def stop() -> None:
    """Switch the device profiler off. Raises SupaError if the runtime refuses."""
    check_error(supart().supaProfilerStop())


def is_active() -> bool:
    """True between `start()` and `stop()`."""
    return _supart._profiler_active


@contextlib.contextmanager
def profile() -> Iterator[None]:
    """Profile the block: `start()` on entry, `stop()` on exit (also on error)."""
    try:
        start()
        yield
    finally:
        stop()
