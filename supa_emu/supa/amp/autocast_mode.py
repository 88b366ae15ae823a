"""Autocast on the supa device and the per-device autocast state (float16 by default)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from supa_emu.device_type import DEVICE_TYPE

__all__ = [
    "autocast", "custom_fwd", "custom_bwd", "get_amp_supported_dtype", "get_autocast_gpu_dtype",
    "is_autocast_enabled", "set_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype",
]



class autocast(torch.amp.autocast_mode.autocast):
    """`torch.autocast` fixed to the supa device: ops inside run in `dtype` (float16 by default)
    where that is numerically safe. Usable as a context manager or decorator; inert under
    TorchScript."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                 cache_enabled: bool = True) -> None:
        if torch._jit_internal.is_scripting():
            self._enabled = enabled
            self.device = DEVICE_TYPE
            self.fast_dtype = dtype
            return
        super().__init__(DEVICE_TYPE, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)

    def __enter__(self) -> "autocast":
        if torch._jit_internal.is_scripting():
            return self
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> Optional[bool]:
        if torch._jit_internal.is_scripting():
            return None
        return super().__exit__(exc_type, exc_val, exc_tb)

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        if torch._jit_internal.is_scripting():
            return func
        return super().__call__(func)


def custom_fwd(fwd: Optional[Callable[..., Any]] = None, *, cast_inputs: Optional[torch.dtype] = None):
    """Decorator for `forward` of a custom autograd Function used under supa autocast.

    With `cast_inputs`, floating-point supa tensor arguments (other than float64) are cast to
    that dtype and the forward runs with autocast disabled; without it, the forward runs in the
    surrounding autocast state. The state is remembered for `custom_bwd`.
    """
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)
    return torch.amp.custom_fwd(fwd, device_type=DEVICE_TYPE, cast_inputs=cast_inputs)


def custom_bwd(bwd: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for `backward` of a custom autograd Function: runs it in the autocast state its
    forward ran in."""
    return torch.amp.custom_bwd(bwd, device_type=DEVICE_TYPE)


def get_amp_supported_dtype() -> list[torch.dtype]:
    """Dtypes autocast may use on supa: [bfloat16, float16, float32]."""
    return [torch.bfloat16, torch.float16, torch.float32]


def is_autocast_enabled() -> bool:
    """True inside an enabled supa autocast region."""
    return torch.is_autocast_enabled(DEVICE_TYPE)


def set_autocast_enabled(enable: bool) -> None:
    """Turn supa autocast on or off for the current thread. Raises TypeError for a non-bool."""
    if not isinstance(enable, bool):
        raise TypeError(f"enabled must be a bool (got {type(enable).__name__})")
    torch.set_autocast_enabled(DEVICE_TYPE, enable)


def get_autocast_dtype() -> torch.dtype:
    """The dtype supa autocast casts to (float16 unless changed)."""
    return torch.get_autocast_dtype(DEVICE_TYPE)


def set_autocast_dtype(dtype: torch.dtype) -> None:
    """Set the dtype supa autocast casts to. Raises TypeError unless given a torch.dtype."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"enabled must be a torch.dtype (got {type(dtype).__name__})")
    torch.set_autocast_dtype(DEVICE_TYPE, dtype)


def get_autocast_gpu_dtype() -> torch.dtype:
    """Older name of `get_autocast_dtype`."""
    return get_autocast_dtype()
