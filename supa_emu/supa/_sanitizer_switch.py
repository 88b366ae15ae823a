"""Whether the stream sanitizer is on, readable without importing it: hooks on hot paths (bccl
collectives) check `active()`, which is a global read while the sanitizer is off."""

from __future__ import annotations

from typing import Any, Optional

_active: Optional[Any] = None  # the enabled supa_emu.supa._sanitizer.SupaSanitizer


def active() -> Optional[Any]:
    """The enabled sanitizer, or None."""
    return _active


def set_active(sanitizer: Optional[Any]) -> None:
    global _active
    _active = sanitizer
