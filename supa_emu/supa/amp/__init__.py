"""Automatic mixed precision for SUPA (`torch.supa.amp`): autocast, custom-function helpers,
the autocast state accessors and the gradient scaler."""

from .autocast_mode import (
    autocast, custom_bwd, custom_fwd, get_amp_supported_dtype, get_autocast_dtype,
    get_autocast_gpu_dtype, is_autocast_enabled, set_autocast_dtype, set_autocast_enabled)
from .grad_scaler import GradScaler

__all__ = [
    "get_amp_supported_dtype", "get_autocast_gpu_dtype", "autocast", "custom_fwd", "custom_bwd",
    "is_autocast_enabled", "set_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype",
]
