"""Parsing of caching-allocator settings ("key:value,key:value", the PYTORCH_SUPA_ALLOC_CONF syntax).

Pure parsing, no torch: config.py validates the environment variable with it before the
emulator starts, and torch.supa's `_set_allocator_settings` applies the same syntax at runtime
(supa_emu/supa/_allocator_config.py).
"""

from __future__ import annotations

from typing import Any, Callable

MiB = 1 << 20
ROUNDUP_INTERVALS = 16  # powers of two from 1 MiB; the last interval is open (matches the core)
_LARGE_BUFFER_MB = 20  # max_split_size_mb must exceed it: an oversize block serves requests this much smaller

DEFAULTS: dict[str, Any] = {
    "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": False,
    "pinned_num_register_threads": 1, "release_lock_on_supamalloc": False,
    "pinned_use_supa_host_register": False, "pinned_reserve_segment_size_mb": 0,
    "pinned_use_background_threads": False, "roundup_power2_divisions": [0] * ROUNDUP_INTERVALS,
    "backend": "native",
}


def _parse_bool(value: str) -> bool:
    if value in ("True", "true", "1"):
        return True
    if value in ("False", "false", "0"):
        return False
    raise ValueError("expected True or False")


def _parse_max_split_size(value: str) -> int:
    megabytes = int(value)
    if megabytes <= _LARGE_BUFFER_MB:
        raise ValueError(f"too small, must be > {_LARGE_BUFFER_MB} (MiB)")
    return megabytes * MiB


def _parse_gc_threshold(value: str) -> float:
    threshold = float(value)
    if not 0.0 < threshold < 1.0:
        raise ValueError("must be between 0.0 and 1.0 (exclusive)")
    return threshold


def _parse_divisions_count(value: str) -> int:
    count = int(value)
    if count < 0 or (count > 1 and count & (count - 1)):
        raise ValueError("the number of divisions must be a power of two")
    return count


def _parse_roundup(value: str) -> list[int]:
    """'4' (every size) or '[256:1,512:2,>:4]' (divisions for sizes up to 256 MiB, up to 512 MiB, larger)."""
    if not value.startswith("["):
        return [_parse_divisions_count(value)] * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise ValueError("a list must be written [size_mb:divisions,...,>:divisions]")
    divisions = [0] * ROUNDUP_INTERVALS
    filled = 0  # intervals below this index are set
    for entry in filter(None, (part.strip() for part in value[1:-1].replace(";", ",").split(","))):
        bound, sep, count = entry.partition(":")
        if not sep:
            raise ValueError(f"entry {entry!r} is not size_mb:divisions")
        count_value = _parse_divisions_count(count.strip())
        if bound.strip() == ">":
            divisions[filled:] = [count_value] * (ROUNDUP_INTERVALS - filled)
            filled = ROUNDUP_INTERVALS
            continue
        megabytes = int(bound)
        if megabytes <= 0 or megabytes & (megabytes - 1):
            raise ValueError(f"interval bound {megabytes} is not a power of two (MiB)")
        # Sizes below `megabytes` MiB: intervals [2**i MiB, 2**(i+1) MiB) with 2**(i+1) <= megabytes.
        upto = min(ROUNDUP_INTERVALS, max(1, megabytes.bit_length() - 1))
        if upto <= filled:
            raise ValueError("interval bounds must increase")
        divisions[filled:upto] = [count_value] * (upto - filled)
        filled = upto
    return divisions


# Accepted keys -> (settings key, parser). CUDA spellings are accepted too because code written
# for torch.cuda passes them through unchanged.
_PARSERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "max_split_size_mb": ("max_split_size", _parse_max_split_size),
    "garbage_collection_threshold": ("garbage_collection_threshold", _parse_gc_threshold),
    "expandable_segments": ("expandable_segments", _parse_bool),
    "pinned_num_register_threads": ("pinned_num_register_threads", int),
    "release_lock_on_supamalloc": ("release_lock_on_supamalloc", _parse_bool),
    "release_lock_on_cudamalloc": ("release_lock_on_supamalloc", _parse_bool),
    "pinned_use_supa_host_register": ("pinned_use_supa_host_register", _parse_bool),
    "pinned_use_cuda_host_register": ("pinned_use_supa_host_register", _parse_bool),
    "pinned_reserve_segment_size_mb": ("pinned_reserve_segment_size_mb", int),
    "pinned_use_background_threads": ("pinned_use_background_threads", _parse_bool),
    "roundup_power2_divisions": ("roundup_power2_divisions", _parse_roundup),
    "backend": ("backend", str),
}


def parse(text: str) -> dict[str, tuple[str, Any]]:
    """{settings key: (the entry as written, parsed value)}; ValueError says which entry is wrong and why."""
    parsed: dict[str, tuple[str, Any]] = {}
    # A list value may contain commas: split on commas outside brackets.
    entries, depth, current = [], 0, ""
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    entries.append(current)
    for item in filter(None, (part.strip() for part in entries)):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if key not in _PARSERS or not sep:
            raise ValueError(f"unrecognized or malformed entry {item!r}; known keys: {', '.join(sorted(_PARSERS))}")
        name, parse_value = _PARSERS[key]
        try:
            result = parse_value(value)
        except ValueError as exc:
            raise ValueError(f"invalid value {value!r} for {key}: {exc}") from None
        if name == "backend" and result != "native":
            raise ValueError(f"allocator backend {result!r} is not available in the emulator; the only backend is 'native'")
        parsed[name] = (item, result)
    return parsed
