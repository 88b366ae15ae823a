"""`torch.supa`: device management and lazy initialisation of the emulated SUPA runtime (torch.cuda's __init__ counterpart).

This package is what `torch._register_device_module('supa', ...)` installs. Its layout follows
`torch.cuda` so a reader finds each concern where they expect it: device selection and lazy
init here, then `memory`, `streams`, `random`, `graphs`, `amp`, and the legacy tensor types.
Everything that touches the native core goes through `_native()` (the module activation
loaded) or the generic `torch.accelerator` / `torch._C._accelerator_*` entry points the core
backs. Like `torch.cuda`, this package keeps no device state of its own: devices, streams,
events, pools and capacities are the core's.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from typing import Any, Callable, Union

import torch

from supa_emu import native as _native_build
from supa_emu.device_type import DEVICE_TYPE

_DeviceLike = Union[torch.device, str, int, None]

# ---------------------------------------------------------------------------------------------
# Lazy initialisation state. The public view of "initialised" is `is_initialized()` (and the
# module attribute `_initialized`, served by `__getattr__` below like the real package does).
_init_done = False
_queued_calls: list[tuple[Callable[[], Any], list[str]]] = []
# Seeding is memory-less: only the latest `manual_seed` ("seed") and the latest
# `manual_seed_all` ("seed_all") call matter. They run after the other queued calls, in the
# order they were last made (the dict's insertion order), as torch.cuda runs them.
_queued_seeds: dict[str, tuple[Callable[[], Any], list[str]]] = {}
_tls = threading.local()
_initialization_lock = threading.Lock()

# One torch.Generator per visible device once initialised (see random.py).
default_generators: tuple[torch.Generator, ...] = ()


class DeferredSupaCallError(Exception):
    """A call queued with `_lazy_call` before initialisation failed when init finally ran it."""


class SupaError(RuntimeError):
    """A SUPA runtime status code other than success, raised by `check_error`."""

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"{_supart.supaGetErrorString(code)} ({code})")


def _native():
    """The native core activation loaded (`supa_emu.native._C`).

    Resolved on use so the package stays importable (for tooling and docs) without a build;
    raises RuntimeError when the emulator is not active in this process. Hot: DeepSpeed reaches
    it ~90 times per training step through current_device() and bccl.
    """
    core = _native_build._C
    if core is None:
        from supa_emu import activation

        core = _native_build.load(activation.config().cache_dir)
    return core


def _is_compiled() -> bool:
    """True when the emulator's native core can be loaded."""
    try:
        _native()
    except Exception:  # no build, a failed build or a library that does not load
        return False
    return True


def _is_in_bad_fork() -> bool:
    """False: a process forked from an initialised one keeps using the cards.

    torch.cuda marks a forked child "bad" because a CUDA context does not survive fork; the
    real torch_supa registers no fork hook, and the emulator's devices, whose memory is the
    process's own, work in the child (docs/real_stack.md, "Lazy initialisation and fork").
    """
    return False


def is_initialized() -> bool:
    """True once `_lazy_init()` has made the runtime usable."""
    return _init_done


def _lazy_call(callable: Callable[[], Any], **kwargs: Any) -> None:
    """Run `callable` now if the runtime is initialised, else queue it for `_lazy_init()`.

    `seed=True` / `seed_all=True` mark a `manual_seed` / `manual_seed_all` call: a later call
    of the same kind replaces it in the queue, and both run after every other queued call.
    Any other keyword raises TypeError.
    """
    unknown = sorted(set(kwargs) - {"seed", "seed_all"})
    if unknown:
        raise TypeError(f"_lazy_call() got unexpected keyword arguments {unknown}; accepted: seed, seed_all")
    if is_initialized():
        callable()
        return
    origin = traceback.format_stack()
    with _initialization_lock:
        if not is_initialized():
            kind = "seed_all" if kwargs.get("seed_all") else "seed" if kwargs.get("seed") else None
            if kind is None:
                _queued_calls.append((callable, origin))
            else:
                _queued_seeds.pop(kind, None)
                _queued_seeds[kind] = (callable, origin)
            return
    callable()  # initialisation finished while this call waited for the lock


def init() -> None:
    """Initialise the SUPA runtime now instead of on first use. Idempotent."""
    _lazy_init()


def _lazy_init() -> None:
    """Initialise the runtime once per process: count devices, create generators, run queued calls.

    Raises RuntimeError("No BIREN GPUs are available") when no device is visible, and
    DeferredSupaCallError when a queued call fails.
    """
    global _init_done, default_generators
    # Checked before the lock: this runs before nearly every torch.supa call.
    if _init_done or getattr(_tls, "is_initializing", False):
        return
    with _initialization_lock:
        if _init_done:
            return
        native = _native()
        if native._device_count() <= 0:
            raise RuntimeError("No BIREN GPUs are available")
        default_generators = tuple(native._default_generators())
        _autograd_threads.register()
        _tls.is_initializing = True
        # The runtime itself is usable from here on; queued calls see an initialised module.
        _init_done = True
        calls = [*_queued_calls, *_queued_seeds.values()]
        _queued_calls.clear()
        _queued_seeds.clear()
        try:
            for queued, origin in calls:
                try:
                    queued()
                except Exception as exc:
                    raise DeferredSupaCallError(
                        f"SUPA call failed lazily at initialization with error: {exc}\n\n"
                        f"SUPA call was originally invoked at:\n\n{''.join(origin)}") from exc
        finally:
            _tls.is_initializing = False


# ---------------------------------------------------------------------------------------------
# Device enumeration and selection.

def is_available() -> bool:
    """True when the native core is present and at least one device is visible. Never initialises."""
    if not _is_compiled():
        return False
    return device_count() > 0


@functools.lru_cache(maxsize=1)
def device_count() -> int:
    """Number of visible SUPA devices; computed on the first call and frozen afterwards."""
    if not _is_compiled():
        return 0
    return int(_native()._device_count())


def current_device() -> int:
    """Index of the currently selected device (initialises the runtime)."""
    _lazy_init()
    return int(_native()._get_device())


def _get_device_index(device: Any, optional: bool = False, allow_cpu: bool = False) -> int:
    """Resolve `device` to a SUPA device index.

    Ints are returned unchanged (no range check); strings go through `torch.device`; a
    `torch.supa.device` context manager yields its index. A torch.device of another type raises
    ValueError ("Expected a supa device, ..."; with `allow_cpu` a CPU device gives -1). With
    `optional`, None or an index-less supa device means the current device; without it, they
    raise ValueError.
    """
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if allow_cpu:
            if device.type not in (DEVICE_TYPE, "cpu"):
                raise ValueError(f"Expected a supa or cpu device, but got: {device}")
            if device.type == "cpu":
                return -1
        elif device.type != DEVICE_TYPE:
            raise ValueError(f"Expected a supa device, but got: {device}")
        if device.index is not None:
            return device.index
    elif isinstance(device, bool):
        raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
    elif isinstance(device, int):
        return device
    elif isinstance(device, _DeviceContext):
        return device.idx
    elif device is not None:
        return torch._utils._get_device_index(device, optional, allow_cpu)
    if optional:
        return current_device()
    raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")


def set_device(device: _DeviceLike) -> None:
    """Select the current device. A negative index is silently ignored."""
    idx = _get_device_index(device, optional=True)
    if idx >= 0:
        _lazy_init()
        _native()._set_device(idx)


def _exchange_device(device: int) -> int:
    """Make `device` current and return the previous index; a negative index returns -1 untouched.

    The one device-switch primitive: `device`, `_DeviceGuard` and Dynamo's tracing of them all
    switch through it and `_maybe_exchange_device`.
    """
    if device < 0:
        return -1
    _lazy_init()
    return int(_native()._exchange_device(device))


def _maybe_exchange_device(device: int) -> int:
    """Like `_exchange_device`; used to restore a previous device when leaving a guard."""
    if device < 0:
        return -1
    return int(_native()._exchange_device(device))


class _DeviceGuard:
    """Device switch by plain index for generated code; restores the previous device on exit."""

    def __init__(self, index: int) -> None:
        self.idx = index
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = _exchange_device(self.idx)

    def __exit__(self, *exc_info: Any) -> bool:
        self.idx = _maybe_exchange_device(self.prev_idx)
        return False


class _DeviceContext(_DeviceGuard):
    """Context manager that makes a device current and restores the previous one on exit.

    `device(-1)` is a no-op; `device(None)` selects the current device. Another negative index
    is rejected by the runtime on entry, as the real package's `device` passes it on.
    """

    def __init__(self, device: _DeviceLike) -> None:
        super().__init__(_get_device_index(device, optional=True))

    def __enter__(self) -> None:
        if self.idx < -1:
            _lazy_init()
            _native()._set_device(self.idx)  # raises: invalid device ordinal
        super().__enter__()


device = _DeviceContext
device.__name__ = device.__qualname__ = "device"


# ---------------------------------------------------------------------------------------------
# Device properties and capabilities.

def get_device_properties(device: _DeviceLike = None) -> "_SupaDeviceProperties":
    """Static properties of a device (default: current). Raises AssertionError("Invalid device id")."""
    idx = _get_device_index(device, optional=True)
    if idx < 0 or idx >= device_count():
        raise AssertionError("Invalid device id")
    _lazy_init()
    return _device_properties(idx)


def get_device_name(device: _DeviceLike = None) -> str:
    """The device's marketing name, e.g. 'BR104'."""
    return get_device_properties(device).name


def get_device_capability(device: _DeviceLike = None) -> tuple[int, int]:
    """(major, minor) architecture version of the device."""
    prop = get_device_properties(device)
    return prop.major, prop.minor


def can_device_access_peer(device: _DeviceLike, peer_device: _DeviceLike) -> bool:
    """True when `device` can address memory on `peer_device` (any two distinct emulated cards).

    Raises AssertionError("Invalid device id") / ("Invalid peer device id") for bad indices.
    """
    _lazy_init()
    idx = _get_device_index(device, optional=True)
    peer = _get_device_index(peer_device)
    if idx < 0 or idx >= device_count():
        raise AssertionError("Invalid device id")
    if peer < 0 or peer >= device_count():
        raise AssertionError("Invalid peer device id")
    return idx != peer


def synchronize(device: _DeviceLike = None) -> None:
    """Wait for all work on the device. Work runs synchronously in the emulator, so this only
    drains the (already complete) streams and fires the device-synchronisation trace callbacks."""
    _lazy_init()
    with _DeviceContext(device):
        idx = int(_native()._get_device())
        torch._C._accelerator_synchronizeDevice(idx)
        if not _gpu_trace.native_reports:  # else the native core reported it
            _gpu_trace.DeviceSynchronizationCallbacks.fire_callbacks()


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """True when bfloat16 tensors can be created on the current device.

    As on the real stack, `including_emulation=False` always answers False, and no device
    means False without raising.
    """
    if not is_available() or not including_emulation:
        return False
    return _probe_bf16(current_device())


@functools.lru_cache(maxsize=16)
def _probe_bf16(idx: int) -> bool:
    try:
        torch.tensor([1.0], dtype=torch.bfloat16, device=torch.device(DEVICE_TYPE, idx))
    except Exception:
        return False
    return True


def _sleep(cycles: int) -> None:
    """Busy the current device for about `cycles` clock cycles (blocks the host: execution is
    synchronous). Non-int input raises RuntimeError."""
    if not isinstance(cycles, int) or isinstance(cycles, bool):
        raise RuntimeError("torch.supa._sleep(): expected 'int'")
    clock_hz = get_device_properties().clock_rate * 1000
    time.sleep(max(cycles, 0) / clock_hz)


_blas_handles: dict[int, int] = {}


def current_blas_handle() -> int:
    """An opaque non-zero handle of the current device's BLAS context (stable per device)."""
    idx = current_device()
    return _blas_handles.setdefault(idx, 0x5B1A0000 + (idx + 1) * 0x100)


def set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
    """Make the stream identified by (stream_id, device_index, device_type) current."""
    torch.accelerator.set_stream(
        torch.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type))


def supart():
    """The runtime-API object (`supaMemGetInfo`, `supaGetErrorString`, ...); initialises first."""
    _lazy_init()
    return _supart


def check_error(res: int) -> None:
    """Raise SupaError unless `res` is the runtime's success code."""
    if res != _supart.supaError.success:
        raise SupaError(res)


def __getattr__(name: str) -> Any:
    if name == "_initialized":
        return is_initialized()
    if name in ("_sanitizer", "_memcheck"):
        # Imported on first use only: a checker costs nothing while nobody asks for it.
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    from supa_emu import compile as compile_support

    if name in compile_support.CODEGEN_NAMES:
        # Inductor asks the PrivateUse1 device module for its code generators; answering
        # here (not at import) keeps torch._inductor out of processes that never compile.
        return compile_support.codegen_class(name)
    raise AttributeError(f"module 'torch_supa.supa' has no attribute '{name}'")


# Submodules import the helpers above, so they come last (the same order torch.cuda uses).
from . import _autograd_threads, _gpu_trace, _supart  # noqa: E402
from ._device_properties import _SupaDeviceProperties, _SUuuid, _device_properties  # noqa: E402,F401
from .memory import *  # noqa: E402,F401,F403
from .memory import _record_memory_history, _set_allocator_settings, _snapshot  # noqa: E402,F401
from .random import *  # noqa: E402,F401,F403
from .streams import *  # noqa: E402,F401,F403
from .graphs import *  # noqa: E402,F401,F403
from .tensor_types import *  # noqa: E402,F401,F403
from .tensor_types import _SupaBase  # noqa: E402,F401
from . import amp, bccl, brtx, graphs, memory, profiler, random, streams, tensor_types  # noqa: E402,F401
from .amp import (  # noqa: E402,F401
    autocast, custom_bwd, custom_fwd, get_amp_supported_dtype, get_autocast_dtype,
    get_autocast_gpu_dtype, is_autocast_enabled, set_autocast_dtype, set_autocast_enabled)

# The package's own exports, as the real torch_supa lists them (docs/real_stack.md, "The
# torch.supa namespace"): device management and lazy init (private names included), five
# submodules and five of amp's names. The submodules' `__all__` give the rest of the 103.
_PACKAGE_NAMES = [
    "_is_compiled", "_is_in_bad_fork", "_lazy_call", "_lazy_init", "_sleep",
    "can_device_access_peer", "check_error", "current_blas_handle", "current_device",
    "default_generators", "device", "device_count", "get_device_name", "get_device_properties",
    "init", "is_available", "is_bf16_supported", "is_initialized", "set_device", "supart",
    "synchronize",
    "amp", "bccl", "brtx", "profiler", "random",
    "get_amp_supported_dtype", "get_autocast_dtype", "is_autocast_enabled", "set_autocast_dtype",
    "set_autocast_enabled",
]
__all__ = [*_PACKAGE_NAMES, *memory.__all__, *random.__all__, *streams.__all__, *graphs.__all__,
           *tensor_types.__all__]
