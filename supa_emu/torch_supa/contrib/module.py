"""`torch_supa.contrib.module`: what the real package changes in PyTorch's modules at import.

As on the real stack (docs/real_stack.md, "torch_supa.contrib.module"), applied once when
`torch_supa` is imported, and so at activation:
- flex attention's device check accepts supa tensors (and CUDA and CPU ones; other devices get
  the real package's error);
- `F.normalize` / `torch.normalize` take `torch.ops.custom.normalize_fused` for contiguous
  float32 supa inputs with p=2, dim=-1, a float eps and no `out`;
- `F.one_hot` takes `torch.ops.custom.one_hot_fused` for contiguous int64 supa tensors with an
  int `num_classes` > 0;
unless BRTB_ENABLE_NATIVE_OP is 1/true/on/yes (read at each call, as the real package does), in
which case both keep PyTorch's own operators.
"""

import functools

import sys

import torch
import torch.nn.functional as F

from supa_emu import config, custom_ops, import_hooks
from supa_emu.device_type import DEVICE_TYPE

_FLEX_DEVICE_TYPES = ("cuda", "cpu", DEVICE_TYPE)
# Importing it costs seconds (Dynamo): patched when a program first imports it.
_FLEX_ATTENTION = "torch.nn.attention.flex_attention"


def _validate_flex_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.device.type not in _FLEX_DEVICE_TYPES:
        raise ValueError("FlexAttention is only supported on CUDA, CPU, or SUPA devices. "
                         f"Found input tensors on {query.device.type} device.")


def _patch_flex_device_check() -> None:
    sys.modules[_FLEX_ATTENTION]._validate_device = _validate_flex_device


def _on_card(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == DEVICE_TYPE


def _wrap_normalize(original):
    @functools.wraps(original)
    def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
        if (not config.native_ops_preferred() and _on_card(input) and p == 2.0 and dim == -1 and out is None
                and input.dtype == torch.float32 and input.dim() >= 1 and input.is_contiguous()
                and isinstance(eps, float)):
            return torch.ops.custom.normalize_fused(input, eps)
        return original(input, p=p, dim=dim, eps=eps, out=out)

    return normalize


def _wrap_one_hot(original):
    @functools.wraps(original)
    def one_hot(tensor, num_classes=-1):
        if (not config.native_ops_preferred() and _on_card(tensor) and tensor.dtype == torch.int64
                and isinstance(num_classes, int) and num_classes > 0 and tensor.is_contiguous()):
            return torch.ops.custom.one_hot_fused(tensor, num_classes)
        return original(tensor, num_classes)

    return one_hot


def _apply() -> None:
    custom_ops.register()
    import_hooks.call_after_import(_FLEX_ATTENTION, _patch_flex_device_check)
    normalize = _wrap_normalize(F.normalize)
    F.normalize = normalize
    torch.normalize = normalize
    F.one_hot = _wrap_one_hot(F.one_hot)


_apply()
