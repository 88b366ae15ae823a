"""The SUPA runtime-API surface (`torch.supa.supart()`), answered by the emulator.

The real object is a C submodule wrapping libsupart. Here there is no driver: calls that
would talk to hardware succeed trivially, and memory queries come from the emulated allocator.
"""

from __future__ import annotations

import enum

import torch


class supaError(enum.IntEnum):
    """Runtime status codes; like the real binding, only `success` is exposed."""

    success = 0


_ERROR_STRINGS = {0: "no error"}
_profiler_active = False


def supaGetErrorString(err: int) -> str:
    """Human-readable text for a runtime status code."""
    return _ERROR_STRINGS.get(int(err), "unrecognized error code")


def supaProfilerStart() -> supaError:
    """Turn the (emulated) device profiler on; returns `supaError.success`."""
    global _profiler_active
    _profiler_active = True
    return supaError.success


def supaProfilerStop() -> supaError:
    """Turn the (emulated) device profiler off; returns `supaError.success`."""
    global _profiler_active
    _profiler_active = False
    return supaError.success


def supaHostRegister(ptr: int, size: int, flags: int) -> supaError:
    """Page-lock a host range. Emulated cards read host memory directly, so there is nothing to
    lock and this always succeeds."""
    return supaError.success


def supaHostUnregister(ptr: int) -> supaError:
    """Undo `supaHostRegister` (nothing to undo in the emulator)."""
    return supaError.success


def supaStreamCreate(ptr: int) -> supaError:
    """Raw stream creation is not needed by the emulator (streams come from torch.supa.Stream)."""
    return supaError.success


def supaStreamDestroy(ptr: int) -> supaError:
    """Counterpart of `supaStreamCreate`; nothing to release."""
    return supaError.success


def supaMemGetInfo(device: int) -> tuple[int, int]:
    """(free, total) bytes of device `device` as the emulated allocator sees them."""
    free, total = torch._C._accelerator_getMemoryInfo(int(device))
    return int(free), int(total)
