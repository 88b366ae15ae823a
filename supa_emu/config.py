"""Every `SUPA_*` environment variable of the project, parsed and validated in one place.

Other modules receive typed values from `load()`; none of them read the environment
themselves. A bad value raises `ConfigError` naming the variable and what it accepts.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

from supa_emu import allocator_settings, card_profiles, switches
from supa_emu.device_profile import DEFAULT_PROFILE, PROFILES, DeviceProfile

MAX_DEVICES = 64
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
    memory_setting: str | None  # SUPA_EMU_MEMORY as written (None: the profile's capacity)
    profile: DeviceProfile
    ext: bool
    dtype_demotion: bool
    transfer: bool  # apply transfer_to_supa at `import torch`, as the real autoload does
    transfer_silence: bool  # BRTB_TRANSFER_SILENCE: no transfer banner
    cache_dir: pathlib.Path
    cache_dir_from_env: bool  # SUPA_EMU_CACHE_DIR chose it (error texts name the variable then)
    deepspeed_accelerator: str  # 'project' | 'builtin'
    allocator_conf: str  # the first set of ALLOCATOR_CONF_VARIABLES, validated; applied when the devices are created
    allocator_conf_source: str  # the variable allocator_conf came from ("" when none is set)
    sanitize: str  # 'off' or comma-joined: 'streams' | 'streams-report', 'memory' | 'memory-strict'
    autograd_device_threads: bool  # backward on autograd's per-device threads (as on a card), not the caller's
    plan_record: pathlib.Path | None  # SUPA_PLAN_RECORD: write this rank's memory and collectives to DIR/rank-R.json
    plan_simulate: bool  # SUPA_PLAN_SIMULATE: bccl groups are a planned world (set by `python -m supa_emu.plan`)
    plan_mode: str  # SUPA_PLAN_MODE: 'compute' (kernels run) | 'shapes' (shape rules, no kernels; set by the planner)
    plan_host_memory: int | None  # SUPA_PLAN_HOST_MEMORY: host tensors a planned rank may hold (None: what the host has free)
    blas_workspace_bytes: int  # one BLAS workspace per (handle, stream); SUPA_EMU_SUBLAS_WORKSPACE_CONFIG or the profile's
    profiler_card: card_profiles.CardProfile  # SUPA_EMU_PROFILER_CARD: whose modelled times torch.profiler's card track shows


def _flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = switches.parse(raw)
    if value is None:
        raise ConfigError(f"{name}={raw!r} is not a valid switch; accepted values: 1/0, true/false, yes/no, on/off")
    return value


# The real transfer_to_supa reads BRTB_TRANSFER_SILENCE itself and accepts these spellings
# (case-insensitive) as "on"; anything else leaves the banner on.
_SILENCE_ON = ("on", "1", "yes", "true", "y")


# The real torch_supa.contrib.module reads BRTB_ENABLE_NATIVE_OP at each call and accepts these
# spellings (case-insensitive) as "on"; anything else leaves the fused normalize/one_hot paths on.
_NATIVE_OP_ON = ("1", "true", "on", "yes")


def native_ops_preferred() -> bool:
    """BRTB_ENABLE_NATIVE_OP: F.normalize / F.one_hot keep PyTorch's operators on supa (read per call)."""
    return os.environ.get("BRTB_ENABLE_NATIVE_OP", "0").lower() in _NATIVE_OP_ON


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
    """Physical ids in the order given. Empty, or a negative id, ends the list as with
    CUDA_VISIBLE_DEVICES (so `-1` hides every card); an id that is not a card or is repeated is
    an error here, where CUDA would silently drop it and the cards after it."""
    raw = os.environ.get("SUPA_VISIBLE_DEVICES")
    if raw is None:
        return tuple(range(count))
    ids = []
    for part in raw.split(","):
        part = part.strip()
        if part == "" or re.fullmatch(r"-[0-9]+", part):
            break
        if not part.isdigit() or int(part) >= count or int(part) in ids:
            raise ConfigError(
                f"SUPA_VISIBLE_DEVICES={raw!r} is invalid at {part!r}; accepted: a comma-separated list of "
                f"distinct card ids from 0 to {count - 1} (SUPA_EMU_DEVICE_COUNT={count}), e.g. '1,0'; "
                f"empty or -1 for no cards (as CUDA_VISIBLE_DEVICES)")
        ids.append(int(part))
    return tuple(ids)


def host_memory_bytes() -> int | None:
    """Physical memory of the host, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_beyond_host(cfg: EmulatorConfig) -> str | None:
    """A warning when SUPA_EMU_MEMORY asks for cards larger than the host's memory, else None.

    Only an explicit setting is checked: the profile's default is the real card's size, and a
    capacity is a ceiling, not a reservation, so a small host can still emulate a big card.
    """
    host = host_memory_bytes()
    if cfg.memory_setting is None or host is None or cfg.memory_bytes <= host:
        return None
    return (f"SUPA_EMU_MEMORY={cfg.memory_setting!r} gives each emulated card {cfg.memory_bytes / 2**30:.1f} GiB, more than this "
            f"host's {host / 2**30:.1f} GiB of memory; allocations the host cannot back fail with a host "
            f"out-of-memory error before the card's capacity is reached")


# How the planner's rank runs operators (supa_emu/csrc/aten/shape_only.h).
PLAN_MODES = ("compute", "shapes")


def _choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default)
    value = raw.strip().lower()
    if value not in accepted:
        raise ConfigError(f"{name}={raw!r} is invalid; accepted values: {', '.join(accepted)}")
    return value


def deepspeed_accelerator() -> str:
    """Which SUPA accelerator DeepSpeed gets: this project's ('project') or its built-in one."""
    return _choice("SUPA_DS_ACCELERATOR", "project", ("project", "builtin"))


# The variables that configure the caching allocator, first set wins: SUPA's own, then the
# device-generic one and CUDA's, which torch 2.13's AcceleratorAllocatorConfig reads in this order
# and which the real stack's out-of-memory message tells users to set.
ALLOCATOR_CONF_VARIABLES = ("PYTORCH_SUPA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def _allocator_conf() -> tuple[str, str]:
    """(the settings string, the variable it came from); ("", "") when none is set."""
    source = next((name for name in ALLOCATOR_CONF_VARIABLES if name in os.environ), "")
    raw = os.environ.get(source, "") if source else ""
    try:
        allocator_settings.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r}: {exc}") from None
    return raw, source


SANITIZE_MODES = ("off", "streams", "streams-report")
# The memory checker's modes; either may be combined with a stream mode ("streams,memory").
MEMCHECK_MODES = ("memory", "memory-strict")


def sanitize_mode() -> str:
    """Which checkers run: 'off', or a comma-joined list of at most one stream mode (the race
    sanitizer, or that one in report-only mode) and one memory mode (bounds, use after free and
    initcheck; 'memory-strict' makes reads of never-written memory errors instead of warnings)."""
    raw = os.environ.get("SUPA_EMU_SANITIZE", "off")
    parts = [part.strip().lower() for part in raw.split(",") if part.strip()] or ["off"]
    accepted = f"{', '.join(SANITIZE_MODES + MEMCHECK_MODES)}, or one stream and one memory mode joined by a comma " \
               f"(e.g. streams,memory)"
    streams = [part for part in parts if part in SANITIZE_MODES[1:]]
    memory = [part for part in parts if part in MEMCHECK_MODES]
    if parts == ["off"]:
        return "off"
    if len(streams) + len(memory) != len(parts) or len(streams) > 1 or len(memory) > 1:
        raise ConfigError(f"SUPA_EMU_SANITIZE={raw!r} is invalid; accepted values: {accepted}")
    return ",".join(streams + memory)


def sanitize_streams(mode: str) -> str | None:
    """The stream sanitizer's mode in a validated SUPA_EMU_SANITIZE value, or None."""
    return next((part for part in mode.split(",") if part in SANITIZE_MODES[1:]), None)


def sanitize_memory(mode: str) -> str | None:
    """The memory checker's mode in a validated SUPA_EMU_SANITIZE value, or None."""
    return next((part for part in mode.split(",") if part in MEMCHECK_MODES), None)


def profiler_card(profile_name: str) -> card_profiles.CardProfile:
    """SUPA_EMU_PROFILER_CARD: a card of card_profiles.PROFILES or a profile file (.toml); unset, the
    emulated card's (SUPA_EMU_PROFILE)."""
    raw = os.environ.get("SUPA_EMU_PROFILER_CARD", "").strip()
    if not raw:
        return card_profiles.PROFILES[profile_name]
    name = next((n for n in card_profiles.PROFILES if n.upper() == raw.upper()), raw)  # names in any case
    try:
        return card_profiles.choose(name)
    except card_profiles.ProfileError as error:
        if name.endswith(".toml") or os.path.sep in name:
            raise ConfigError(f"SUPA_EMU_PROFILER_CARD: {error}") from None
        raise ConfigError(f"SUPA_EMU_PROFILER_CARD={raw!r} is unknown; accepted values: {', '.join(card_profiles.PROFILES)}, "
                          f"or a card profile file (.toml, docs/time_on_the_card.md)") from None


def _plan_record() -> pathlib.Path | None:
    raw = os.environ.get("SUPA_PLAN_RECORD", "").strip()
    if not raw:
        return None
    path = pathlib.Path(raw)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"SUPA_PLAN_RECORD={raw!r} is a file; accepted: a directory (created if missing) "
                          f"that receives one rank-R.json per rank")
    return path


def blas_workspace_bytes(profile: DeviceProfile) -> int:
    """SUPA_EMU_SUBLAS_WORKSPACE_CONFIG in CUBLAS_WORKSPACE_CONFIG's form, ':SIZE:COUNT' repeated
    (SIZE in KiB; the workspace is the sum of SIZE x COUNT, so ':4096:8' is 32 MiB and ':0:0' none);
    unset: the profile's size."""
    name = "SUPA_EMU_SUBLAS_WORKSPACE_CONFIG"
    raw = os.environ.get(name)
    if raw is None:
        return profile.blas_workspace_size
    pairs = re.fullmatch(r"(?::[0-9]+:[0-9]+)+", raw.strip())
    if pairs is None:
        raise ConfigError(f"{name}={raw!r} is invalid; accepted: one or more ':SIZE:COUNT' pairs as in "
                          f"CUBLAS_WORKSPACE_CONFIG (SIZE in KiB, COUNT chunks, summed), e.g. ':4096:8' (32 MiB), "
                          f"':4096:2:16:8', or ':0:0' for no workspace")
    numbers = [int(part) for part in raw.strip().split(":")[1:]]
    return sum(size * count for size, count in zip(numbers[::2], numbers[1::2])) * 1024


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
    allocator_conf, allocator_conf_source = _allocator_conf()
    return EmulatorConfig(
        emulate=emulation_requested(),
        device_count=count,
        visible_devices=_visible_devices(count),
        memory_bytes=memory,
        memory_setting=raw_memory,
        profile=dataclasses.replace(profile, total_memory=memory),
        ext=_flag("SUPA_EMU_EXT"),
        dtype_demotion=_flag("BRTB_ENABLE_DTYPE_DEMOTION"),
        transfer=_flag("SUPA_EMU_TRANSFER", default=True),
        transfer_silence=os.environ.get("BRTB_TRANSFER_SILENCE", "").strip().lower() in _SILENCE_ON,
        cache_dir=pathlib.Path(cache),
        cache_dir_from_env=bool(os.environ.get("SUPA_EMU_CACHE_DIR")),
        deepspeed_accelerator=deepspeed_accelerator(),
        allocator_conf=allocator_conf,
        allocator_conf_source=allocator_conf_source,
        sanitize=sanitize_mode(),
        autograd_device_threads=_flag("SUPA_EMU_AUTOGRAD_DEVICE_THREADS"),
        plan_record=_plan_record(),
        plan_simulate=_flag("SUPA_PLAN_SIMULATE"),
        plan_mode=_choice("SUPA_PLAN_MODE", "compute", PLAN_MODES),
        plan_host_memory=(parse_size("SUPA_PLAN_HOST_MEMORY", os.environ["SUPA_PLAN_HOST_MEMORY"])
                          if os.environ.get("SUPA_PLAN_HOST_MEMORY") else None),
        blas_workspace_bytes=blas_workspace_bytes(profile),
        profiler_card=profiler_card(profile_name),
    )
