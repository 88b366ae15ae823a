"""Caching-allocator settings at runtime (`_set_allocator_settings`, PYTORCH_SUPA_ALLOC_CONF syntax).

The syntax is parsed by supa_emu/allocator_settings.py. As on CUDA, each string sets
`max_split_size_mb`, `garbage_collection_threshold` and `roundup_power2_divisions` (to their
defaults where it does not name them); the others keep their value. Those three,
`graph_capture_record_stream_reuse` and `expandable_segments` act in the native allocator. The
others would change a driver interaction the emulator does not have; setting them warns that they
are not modelled (their value is still reported in `_snapshot()["allocator_settings"]`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

from supa_emu import allocator_settings, process_state

_settings: dict[str, Any] = dict(allocator_settings.DEFAULTS)

# Why a setting changes nothing in the emulator, by settings key.
_NOT_MODELLED = {
    "release_lock_on_supamalloc": "there is no driver call to release the lock around",
    "pinned_num_register_threads": "pinned blocks are host memory the runtime marks as pinned, with no driver registration",
    "pinned_use_supa_host_register": "pinned blocks are host memory the runtime marks as pinned, with no driver registration",
    "pinned_reserve_segment_size_mb": "pinned blocks are allocated one by one, with no reserved segment",
    "pinned_use_background_threads": "freed pinned blocks are checked against their streams on the next allocation, with no background thread",
}


def apply(text: str, source: str = "SUPA allocator config", error: type[Exception] = RuntimeError) -> None:
    """Applies a "key:value,..." string; `error` (naming `source`) for a bad entry."""
    try:
        parsed = allocator_settings.parse(text)
    except ValueError as exc:
        raise error(f"{source}: {exc}") from None
    for name in allocator_settings.RESET_BY_EACH_STRING:
        _settings[name] = allocator_settings.DEFAULTS[name]
    for name, (entry, value) in parsed.items():
        if name in _NOT_MODELLED and value != allocator_settings.DEFAULTS[name]:
            warnings.warn(f"SUPA allocator setting {entry} is not modelled by the emulator: {_NOT_MODELLED[name]}",
                          UserWarning, stacklevel=3)
        _settings[name] = value
    process_state.core()._set_allocator_knobs(
        _settings["max_split_size"], _settings["garbage_collection_threshold"], _settings["roundup_power2_divisions"],
        _settings["graph_capture_record_stream_reuse"], _settings["expandable_segments"])


def install_accelerator_hook() -> None:
    """Makes PyTorch's device-generic entry (`torch._C._accelerator_setAllocatorSettings`) set
    supa's allocator too, as it sets CUDA's; a bad entry raises ValueError there, as on CUDA."""
    process_state.core()._install_accelerator_settings_hook(
        functools.partial(apply, source="allocator settings", error=ValueError), list(allocator_settings.KEYS))


def _set_allocator_settings(env: str) -> None:
    """Apply a PYTORCH_SUPA_ALLOC_CONF-style string ("key:value,key:value") at runtime.

    Raises RuntimeError for unknown keys or malformed values, and for a `backend` other than
    "native" (the only one the emulator has).
    """
    apply(env)


def allocator_settings_in_effect() -> dict[str, Any]:
    """A copy of the current settings, as `_snapshot()` reports them."""
    return {key: list(value) if isinstance(value, list) else value for key, value in _settings.items()}


def get_allocator_backend() -> str:
    """Name of the active allocator backend: always 'native' (the caching allocator)."""
    return "native"
