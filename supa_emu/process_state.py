"""The emulator's state in this process: whether activation ran, the configuration and native core
it loaded, and whether the `torch.supa` runtime has been initialised.

A leaf module (it imports nothing of supa_emu), so every part of the emulator reads this state
from here without importing the code that sets it up. Activation records its decision, the
configuration and the core; `torch.supa`'s lazy initialisation records the runtime's
initialisation. Everything else the emulated cards hold (devices, memory, streams, generators)
is the native core's, reached through `core()`.
"""

from __future__ import annotations

from typing import Any

_NOT_ACTIVE = "supa_emu is not active in this process: set SUPA_EMULATE=1 before importing torch"

_decision: bool | None = None  # None until activation decided: True emulates, False stood down
_config: Any = None  # the validated supa_emu.config.EmulatorConfig activation loaded
_core: Any = None  # the native core module activation loaded and initialised
_initialized = False
# The Python generator objects `torch.supa.default_generators` holds: made once at
# initialisation, so that every read returns the same objects (as torch.cuda's tuple does).
_default_generators: tuple = ()


# ---------------------------------------------------------------- written by activation

def record_decision(emulating: bool) -> None:
    global _decision
    _decision = emulating


def record_config(config: Any) -> None:
    global _config
    _config = config


def record_core(core: Any) -> None:
    global _core
    _core = core


# ---------------------------------------------------------------- written by torch.supa's lazy init

def record_initialized(default_generators: tuple) -> None:
    """The runtime is usable from now on; `default_generators` are the devices' generators."""
    global _initialized, _default_generators
    _default_generators = default_generators
    _initialized = True


# ---------------------------------------------------------------- read by everything else

def decision() -> bool | None:
    """None until activation decided; then True (emulating) or False (a real torch_supa is installed)."""
    return _decision


def is_active() -> bool:
    return bool(_decision)


def config() -> Any:
    """The configuration this process was activated with; RuntimeError before activation."""
    if _config is None:
        raise RuntimeError(_NOT_ACTIVE)
    return _config


def core() -> Any:
    """The loaded native core; RuntimeError when the emulator is not active in this process.

    Hot: DeepSpeed reaches it ~90 times per training step through current_device() and bccl.
    """
    if _core is None:
        raise RuntimeError(_NOT_ACTIVE)
    return _core


def is_initialized() -> bool:
    return _initialized


def default_generators() -> tuple:
    """One torch.Generator per visible device once initialised, else ()."""
    return _default_generators
