"""Gradient scaling for float16 training on SUPA (`torch.supa.amp.GradScaler`)."""

from __future__ import annotations

import warnings
from typing import Optional, Union

import torch

from supa_emu.device_type import DEVICE_TYPE

from .common import amp_definitely_not_available

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` for the supa device.

    When enabled but no SUPA device is available it warns and disables itself. Raises
    AssertionError for `growth_factor <= 1` or `backoff_factor >= 1` (when enabled).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if enabled and amp_definitely_not_available():
            warnings.warn("torch.supa.amp.GradScaler is enabled, but SUPA is not available.  Disabling.",
                          stacklevel=2)
            enabled = False
        super().__init__(DEVICE_TYPE, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        # SUPA scales float16 gradients fine; what must not be unscaled here is bfloat16 grads
        # unless the caller explicitly allows reduced-precision grads.
        if not allow_fp16:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None and param.grad.dtype == torch.bfloat16:
                        raise ValueError("Attempting to unscale BF16 gradients.")
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def update(self, new_scale: Optional[Union[float, torch.Tensor]] = None) -> None:
        """Update the scale for the next iteration; `new_scale` (a float or a 1-element supa
        float tensor without grad) sets it directly. Raises AssertionError for other values or
        when no inf checks were recorded since the last update."""
        if self._enabled and new_scale is not None and not isinstance(new_scale, float):
            reason = ("new_scale should be a float or a 1-element torch.supa.FloatTensor with "
                      "requires_grad=False.")
            if not isinstance(new_scale, torch.Tensor):
                raise AssertionError(reason)
            if new_scale.device.type != DEVICE_TYPE or new_scale.numel() != 1 or new_scale.requires_grad:
                raise AssertionError(reason)
            # The scale is 0-dim; accept any 1-element shape (e.g. [1]) as the reference does.
            new_scale = new_scale.reshape(())
        super().update(new_scale)
