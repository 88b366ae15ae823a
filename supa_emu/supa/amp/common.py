"""Availability check shared by the AMP helpers."""

from .._runtime import is_available


def amp_definitely_not_available() -> bool:
    """True when no SUPA device can run mixed precision (no device visible)."""
    return not is_available()
