"""`torch_supa.backends.supa`: whether SUPA support is built, and the preferred BLAS library.

The transfer copies both onto `torch.backends.cuda` (docs/real_stack.md, "torch.backends.supa").
"""

from __future__ import annotations

import os
import warnings

__all__ = ["is_built", "preferred_blas_library"]

_BLAS_CHOICES = {"cublas": "Sublas", "sublas": "Sublas", "cublaslt": "Sublaslt", "sublaslt": "Sublaslt"}
_ENV = "BRTB_SUBLAS_PREFERRED_BACKEND"


def is_built() -> bool:
    """True: this PyTorch has SUPA support."""
    return True


def preferred_blas_library(backend: str | None = None) -> None:
    """Choose the BLAS library of SUPA matrix products: cublas/sublas -> Sublas, cublaslt/sublaslt -> Sublaslt.

    As on the real stack the choice is stored in BRTB_SUBLAS_PREFERRED_BACKEND and None is
    returned; `None` leaves the choice unchanged. The emulator computes every product with
    PyTorch's CPU BLAS, so it warns that the choice does not change its results.
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise RuntimeError("Unknown input value type.")
    if backend.lower() not in _BLAS_CHOICES:
        raise RuntimeError("Unknown input value. Choose from: cublas, cublaslt, sublas, sublaslt.")
    os.environ[_ENV] = _BLAS_CHOICES[backend.lower()]
    warnings.warn("the SUPA emulator runs every matrix product on PyTorch's CPU BLAS; the preferred "
                  f"SUPA BLAS library ({os.environ[_ENV]}) is recorded but does not change results")
    return None
