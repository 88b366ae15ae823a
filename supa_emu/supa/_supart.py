"""The SUPA runtime-API surface (`torch.supa.supart()`), answered by the emulator.

The real object is a C submodule wrapping libsupart. Here there is no driver: page-locking
succeeds (emulated cards read host memory directly), memory queries come from the emulated
allocator, and raw stream handles, which nothing here could back, raise NotImplementedError.
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


_NO_RAW_STREAMS = ("{name}: the emulator does not model raw runtime streams (there is no handle to write "
                   "to or release); create streams with torch.supa.Stream() instead")


def supaStreamCreate(ptr: int) -> supaError:
    """Raw stream creation through a handle pointer: not modelled, raises NotImplementedError."""
    raise NotImplementedError(_NO_RAW_STREAMS.format(name="supaStreamCreate"))


def supaStreamDestroy(ptr: int) -> supaError:
    """Counterpart of `supaStreamCreate`: not modelled, raises NotImplementedError."""
    raise NotImplementedError(_NO_RAW_STREAMS.format(name="supaStreamDestroy"))


def supaMemGetInfo(device: int) -> tuple[int, int]:
    """(free, total) bytes of device `device` as the emulated allocator sees them."""
    free, total = torch._C._accelerator_getMemoryInfo(int(device))
    return int(free), int(total)
