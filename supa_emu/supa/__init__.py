"""`torch.supa`: device management and lazy initialisation of the emulated SUPA runtime (torch.cuda's __init__ counterpart).

This package is what `torch._register_device_module('supa', ...)` installs. Its layout follows
`torch.cuda` so a reader finds each concern where they expect it: device selection and lazy
init (in `_runtime.py`, re-exported here; its siblings import it, never this package), then
`memory`, `streams`, `random`, `graphs`, `amp`, and the legacy tensor types. Everything that
touches the native core goes through `_native()` (the core activation loaded) or the generic
`torch.accelerator` / `torch._C._accelerator_*` entry points the core backs. Like `torch.cuda`,
this package holds no device state: devices, streams, events, pools, capacities and generators
are the core's; the configuration, the loaded core and whether the runtime is initialised are
`supa_emu/process_state.py`'s. What Python state is left belongs to one module each (the calls
queued before initialisation, the checkers' switch, the allocator settings in effect).
"""

from __future__ import annotations

from typing import Any

from supa_emu import process_state

from ._runtime import (  # noqa: F401
    DeferredSupaCallError, SupaError, _clear_sublas_workspaces, _DeviceContext, _DeviceGuard, _exchange_device, _get_device_index,
    _is_compiled, _is_in_bad_fork, _lazy_call, _lazy_init, _maybe_exchange_device, _native, _probe_bf16,
    _sleep, can_device_access_peer, check_error, current_blas_handle, current_device, device, device_count,
    get_device_capability, get_device_name, get_device_properties, init, is_available, is_bf16_supported,
    is_initialized, set_device, set_stream_by_id, supart, synchronize)


def __getattr__(name: str) -> Any:
    if name == "_initialized":
        return is_initialized()
    if name == "default_generators":
        # Read on each access: the tuple exists once the runtime is initialised.
        return process_state.default_generators()
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


from . import _autograd_threads, _gpu_trace, _supart  # noqa: E402,F401
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
