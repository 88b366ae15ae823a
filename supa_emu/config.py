"""Every `SUPA_*` environment variable of the project, parsed and validated in one place.

Other modules receive typed values from `load()`; none of them read the environment
themselves. A bad value raises `ConfigError` naming the variable and what it accepts.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

from supa_emu.device_profile import DEFAULT_PROFILE, PROFILES, DeviceProfile

MAX_DEVICES = 64
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class ConfigError(ValueError):
    """A SUPA_* variable holds a value the project does not accept."""


@dataclasses.dataclass(frozen=True)
class EmulatorConfig:
    emulate: bool
    device_count: int  # emulated physical cards
    visible_devices: tuple[int, ...]  # physical ids, in the order the process sees them
    memory_bytes: int  # capacity of each card
    profile: DeviceProfile
    ext: bool
    dtype_demotion: bool
    cache_dir: pathlib.Path
    deepspeed_accelerator: str  # 'project' | 'builtin'


def _flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a valid switch; accepted values: 1/0, true/false, yes/no, on/off")


def emulation_requested() -> bool:
    """True when SUPA_EMULATE asks for emulation. Cheap: reads one variable."""
    return _flag("SUPA_EMULATE")


def parse_size(name: str, raw: str) -> int:
    """'32GiB', '512M', '1.5G', '1073741824' -> bytes (binary units for K/M/G/T and *iB)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", raw)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(
            f"{name}={raw!r} is not a memory size; accepted: a number of bytes or a number with a unit "
            f"(KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB), e.g. 16GiB or 512M")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1 << 20:
        raise ConfigError(f"{name}={raw!r} is too small; the emulated card needs at least 1MiB")
    return size


def _device_count() -> int:
    raw = os.environ.get("SUPA_EMU_DEVICE_COUNT")
    if raw is None:
        return 8
    if not raw.strip().isdigit() or int(raw) > MAX_DEVICES:
        raise ConfigError(f"SUPA_EMU_DEVICE_COUNT={raw!r} is invalid; accepted: an integer from 0 to {MAX_DEVICES}")
    return int(raw)


def _visible_devices(count: int) -> tuple[int, ...]:
    raw = os.environ.get("SUPA_VISIBLE_DEVICES")
    if raw is None:
        return tuple(range(count))
    if raw.strip() == "":
        return ()
    ids = []
    for part in raw.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= count or int(part) in ids:
            raise ConfigError(
                f"SUPA_VISIBLE_DEVICES={raw!r} is invalid at {part!r}; accepted: a comma-separated list of "
                f"distinct card ids from 0 to {count - 1} (SUPA_EMU_DEVICE_COUNT={count}), e.g. '1,0'")
        ids.append(int(part))
    return tuple(ids)


def _choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default)
    value = raw.strip().lower()
    if value not in accepted:
        raise ConfigError(f"{name}={raw!r} is invalid; accepted values: {', '.join(accepted)}")
    return value


def deepspeed_accelerator() -> str:
    """Which SUPA accelerator DeepSpeed gets: this project's ('project') or its built-in one."""
    return _choice("SUPA_DS_ACCELERATOR", "project", ("project", "builtin"))


def load() -> EmulatorConfig:
    """Read and validate every variable; raises ConfigError on the first bad one."""
    profile_name = os.environ.get("SUPA_EMU_PROFILE", DEFAULT_PROFILE).strip().upper()
    if profile_name not in PROFILES:
        raise ConfigError(f"SUPA_EMU_PROFILE={profile_name!r} is unknown; accepted values: {', '.join(PROFILES)}")
    profile = PROFILES[profile_name]
    raw_memory = os.environ.get("SUPA_EMU_MEMORY")
    memory = profile.total_memory if raw_memory is None else parse_size("SUPA_EMU_MEMORY", raw_memory)
    count = _device_count()
    cache = os.environ.get("SUPA_EMU_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "supa_emu")
    return EmulatorConfig(
        emulate=emulation_requested(),
        device_count=count,
        visible_devices=_visible_devices(count),
        memory_bytes=memory,
        profile=dataclasses.replace(profile, total_memory=memory),
        ext=_flag("SUPA_EMU_EXT"),
        dtype_demotion=_flag("BRTB_ENABLE_DTYPE_DEMOTION"),
        cache_dir=pathlib.Path(cache),
        deepspeed_accelerator=deepspeed_accelerator(),
    )
