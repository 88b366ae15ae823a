"""Precision rules shared by the reference kernels: math in fp32, results in the input's dtype.

DeepSpeed's kernels load fp16/bf16 values, compute in float and store back in the storage type;
doing the same keeps the reference kernels within one rounding of the real ones.
"""

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the math for tensor ``t`` runs in: float64 stays, everything else is float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype (no copy when it already is)."""
    return t.to(compute_dtype(t))
