"""Device management and lazy initialisation of the emulated SUPA runtime: what torch.cuda keeps
in its `__init__.py`, in a module of its own so that `torch.supa`'s submodules import it without
importing their package back. `supa_emu/supa/__init__.py` re-exports all of it.
"""

from __future__ import annotations

import functools
import threading
import traceback
from typing import Any, Callable, Union

import torch

from supa_emu import process_state
from supa_emu.device_type import DEVICE_TYPE

from . import _autograd_threads, _gpu_trace, _supart
from ._device_properties import _SupaDeviceProperties, _device_properties

_DeviceLike = Union[torch.device, str, int, None]

# ---------------------------------------------------------------------------------------------
# Lazy initialisation. Whether the runtime is initialised, and the devices' generators, are
# process state (supa_emu/process_state.py); what is kept here is the bookkeeping of getting
# there: the calls queued until then, and the lock and thread flag of the one initialisation.
_queued_calls: list[tuple[Callable[[], Any], list[str]]] = []
# Seeding is memory-less: only the latest `manual_seed` ("seed") and the latest
# `manual_seed_all` ("seed_all") call matter. They run after the other queued calls, in the
# order they were last made (the dict's insertion order), as torch.cuda runs them.
_queued_seeds: dict[str, tuple[Callable[[], Any], list[str]]] = {}
_tls = threading.local()
_initialization_lock = threading.Lock()


class DeferredSupaCallError(Exception):
    """A call queued with `_lazy_call` before initialisation failed when init finally ran it."""


class SupaError(RuntimeError):
    """A SUPA runtime status code other than success, raised by `check_error`."""

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"{_supart.supaGetErrorString(code)} ({code})")


# The native core activation loaded; RuntimeError when the emulator is not active in this
# process. Resolved on use, so the package stays importable (for tooling and docs) without a build.
_native = process_state.core


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
    return process_state.is_initialized()


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
    # Checked before the lock: this runs before nearly every torch.supa call.
    if process_state.is_initialized() or getattr(_tls, "is_initializing", False):
        return
    with _initialization_lock:
        if process_state.is_initialized():
            return
        native = _native()
        if native._device_count() <= 0:
            raise RuntimeError("No BIREN GPUs are available")
        generators = tuple(native._default_generators())
        _autograd_threads.register()
        _tls.is_initializing = True
        # The runtime itself is usable from here on; queued calls see an initialised module.
        process_state.record_initialized(generators)
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


def device_count() -> int:
    """Number of visible SUPA devices (0 when the emulator is not active); fixed at activation."""
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
    """Queue `cycles` clock cycles of spinning on the current stream, as CUDA's `_sleep` kernel does.

    The host returns at once (work is synchronous, there is nothing to run); the stream stays busy
    for cycles / clock rate seconds: its `query()` is False and synchronisations, and events
    recorded after, wait until then. Non-positive counts queue nothing; non-int input raises
    RuntimeError.
    """
    if not isinstance(cycles, int) or isinstance(cycles, bool):
        raise RuntimeError("torch.supa._sleep(): expected 'int'")
    if not -_INT64_LIMIT <= cycles < _INT64_LIMIT:  # the runtime takes an int64, as CUDA's does
        raise RuntimeError("Overflow when unpacking long")
    stream = torch.accelerator.current_stream(current_device())
    clock_hz = get_device_properties(stream.device_index).clock_rate * 1000
    ns = min(max(cycles, 0) * 1_000_000_000 // clock_hz, _INT64_LIMIT - 1)
    _native()._queue_stream_work(stream.device_index, stream.stream_id, ns)


_INT64_LIMIT = 1 << 63


def current_blas_handle() -> int:
    """This thread's BLAS handle on the current device (an opaque non-zero int; initialises).
    Each thread has its own per device; a thread that ends gives its handles back for reuse."""
    _lazy_init()
    return int(_native()._current_blas_handle(current_device()))


def _clear_sublas_workspaces() -> None:
    """Free the BLAS workspaces every (handle, stream) keeps since its first matrix product (the
    real stack's `torch_supa._C._supa_clearSublasWorkspaces`, CUDA's `_cuda_clearCublasWorkspaces`)."""
    if _is_compiled():
        _native()._clear_blas_workspaces()


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
