"""The `custom::` operators the real libtorch_supa registers and `torch_supa.contrib.module` calls:
`normalize_fused(input, eps)`, `one_hot_fused(self, num_classes)` and `_get_data_ptr(self)`.

Their values are those of the operations they fuse (F.normalize over the last dimension with
p=2, F.one_hot), computed by PyTorch's own operators on the device, so autograd and torch.compile
see through them as through F.normalize. Registered once, at activation.
"""

import torch

_library = None


def _normalize_fused(input: torch.Tensor, eps: float) -> torch.Tensor:
    # x / max(||x||_2, eps) along the last dimension, the definition F.normalize uses.
    return input / torch.linalg.vector_norm(input, 2, -1, keepdim=True).clamp_min(eps)


def _one_hot_fused(self: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.ops.aten.one_hot(self, num_classes)


def _get_data_ptr(self: torch.Tensor) -> int:
    return self.data_ptr()


def register() -> None:
    """Defines the operators (idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("custom", "FRAGMENT")
    for schema, kernel in (
        ("normalize_fused(Tensor input, float eps) -> Tensor", _normalize_fused),
        ("one_hot_fused(Tensor self, int num_classes) -> Tensor", _one_hot_fused),
        ("_get_data_ptr(Tensor self) -> int", _get_data_ptr),
    ):
        library.define(schema)
        library.impl(schema.split("(")[0], kernel, "CompositeImplicitAutograd")
    _library = library
