"""Parsing of caching-allocator settings ("key:value,key:value", the PYTORCH_SUPA_ALLOC_CONF syntax).

Pure parsing, no torch: config.py validates the environment variable with it before the
emulator starts, and torch.supa's `_set_allocator_settings` applies the same syntax at runtime
(supa_emu/supa/_allocator_config.py).
"""

from __future__ import annotations

from typing import Any, Callable

MiB = 1 << 20
ROUNDUP_INTERVALS = 16  # powers of two from 1 MiB; the last interval is open (matches the core)
_MAX_REGISTER_THREADS = 128  # pinned_num_register_threads, as CUDA's
_LARGE_BUFFER_MB = 20  # the least max_split_size_mb: an oversize block serves requests this much smaller

DEFAULTS: dict[str, Any] = {
    "max_split_size": -1, "garbage_collection_threshold": 0.0, "expandable_segments": False,
    "pinned_num_register_threads": 1, "release_lock_on_supamalloc": False,
    "pinned_use_supa_host_register": False, "pinned_reserve_segment_size_mb": 0,
    "pinned_use_background_threads": False, "roundup_power2_divisions": [0] * ROUNDUP_INTERVALS,
    "backend": "native", "graph_capture_record_stream_reuse": False,
}
# Settings that every settings string sets, to their default where it does not name them (as
# PyTorch's allocator config does); the others keep their value until a string names them.
RESET_BY_EACH_STRING = ("max_split_size", "garbage_collection_threshold", "roundup_power2_divisions")


def _parse_bool(value: str) -> bool:
    if value in ("True", "true", "1"):
        return True
    if value in ("False", "false", "0"):
        return False
    raise ValueError("expected True or False")


def _parse_max_split_size(value: str) -> int:
    megabytes = int(value)
    if megabytes < _LARGE_BUFFER_MB:
        raise ValueError(f"too small, must be >= {_LARGE_BUFFER_MB} (MiB)")
    return megabytes * MiB


def _parse_register_threads(value: str) -> int:
    threads = int(value)
    if threads <= 0 or threads & (threads - 1) or threads > _MAX_REGISTER_THREADS:
        raise ValueError(f"must be a power of two, at most {_MAX_REGISTER_THREADS}")
    return threads


def _parse_reserve_segment_size(value: str) -> int:
    megabytes = int(value)
    if megabytes <= 0:
        raise ValueError("must be greater than 0")
    return megabytes


def _parse_gc_threshold(value: str) -> float:
    threshold = float(value)
    if not 0.0 < threshold < 1.0:
        raise ValueError("must be between 0.0 and 1.0 (exclusive)")
    return threshold


def _parse_divisions_count(value: str, zero_allowed: bool) -> int:
    count = int(value)
    if count < 0 or (count == 0 and not zero_allowed) or count & (count - 1):
        raise ValueError("the number of divisions must be a power of two" + (" or 0" if zero_allowed else ""))
    return count


def _parse_roundup(value: str) -> list[int]:
    """'4' (every size) or a list '[64:8,256:4,>:1]', read as PyTorch 2.13's allocator reads it:
    entry 'N:d' sets the interval [N MiB, 2N MiB) (the first entry also every interval below it),
    '>:d' every interval after the last one named; intervals no entry reaches stay 0 (no rounding)."""
    if not value.startswith("["):
        return [_parse_divisions_count(value, zero_allowed=False)] * ROUNDUP_INTERVALS
    if not value.endswith("]"):
        raise ValueError("a list must be written [size_mb:divisions,...,>:divisions]")
    divisions = [0] * ROUNDUP_INTERVALS
    last = 0  # the interval of the last size named
    first = True
    for entry in filter(None, (part.strip() for part in value[1:-1].replace(";", ",").split(","))):
        bound, sep, count = entry.partition(":")
        if not sep:
            raise ValueError(f"entry {entry!r} is not size_mb:divisions")
        count_value = _parse_divisions_count(count.strip(), zero_allowed=True)
        if bound.strip() == ">":
            divisions[last + 1:] = [count_value] * (ROUNDUP_INTERVALS - last - 1)
            continue
        megabytes = int(bound)
        if megabytes <= 0 or megabytes & (megabytes - 1):
            raise ValueError(f"interval bound {megabytes} is not a power of two (MiB)")
        last = min(megabytes.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            divisions[:last] = [count_value] * last
            first = False
        divisions[last] = count_value
    return divisions


# Accepted keys -> (settings key, parser). CUDA spellings are accepted too because code written
# for torch.cuda passes them through unchanged.
_PARSERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "max_split_size_mb": ("max_split_size", _parse_max_split_size),
    "garbage_collection_threshold": ("garbage_collection_threshold", _parse_gc_threshold),
    "expandable_segments": ("expandable_segments", _parse_bool),
    "pinned_num_register_threads": ("pinned_num_register_threads", _parse_register_threads),
    "release_lock_on_supamalloc": ("release_lock_on_supamalloc", _parse_bool),
    "release_lock_on_cudamalloc": ("release_lock_on_supamalloc", _parse_bool),
    "pinned_use_supa_host_register": ("pinned_use_supa_host_register", _parse_bool),
    "pinned_use_cuda_host_register": ("pinned_use_supa_host_register", _parse_bool),
    "pinned_reserve_segment_size_mb": ("pinned_reserve_segment_size_mb", _parse_reserve_segment_size),
    "pinned_use_background_threads": ("pinned_use_background_threads", _parse_bool),
    "roundup_power2_divisions": ("roundup_power2_divisions", _parse_roundup),
    "backend": ("backend", str),
    "graph_capture_record_stream_reuse": ("graph_capture_record_stream_reuse", _parse_bool),
}


KEYS = tuple(_PARSERS)  # every key a settings string may name


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
