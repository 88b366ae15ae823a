"""transfer_to_supa: CUDA-named code runs on SUPA cards (`import torch_supa.contrib.transfer_to_supa`).

Importing this module applies the transfer once, as the real module does (docs/real_stack.md,
"transfer_to_supa"): "cuda" device strings mean "supa"; `torch.cuda.*` answers for the SUPA
cards (the names of `CUDA_NAMES` are copied onto the existing `torch.cuda` module, so CUDA's
other helpers call supa's through their module globals); `.cuda()` and `is_cuda` mean supa; autocast, nvtx,
CUDA graphs and the profiler's CUDA activity map to their SUPA counterparts; "nccl" becomes
"bccl" in torch.distributed; checkpoints tagged "cuda:N" load onto supa:N.

This is by nature one large monkeypatch of PyTorch; it is kept in this one module, which is what
the real package does too. Each step below says what it patches and why. What the real module
patches and this one does not is listed in docs/cuda_code.md, "What is not redirected".

The device strings are the one part done below Python (csrc/runtime/device_strings.cpp), because
PyTorch parses them in C++ wherever a device is accepted.
"""

from __future__ import annotations

import functools
import os
import sys
import types
import warnings

import torch
import torch.distributed as dist

import supa_emu.supa as supa
from supa_emu import process_state
from supa_emu.device_type import DEVICE_TYPE
from supa_emu.distributed import DEFAULT_TIMEOUT, ProcessGroupBCCL

__all__: list[str] = []

# Whatever torch.cuda.is_available was before the transfer (the real module keeps it too).
is_available = torch.cuda.is_available

# The CUDA toolkit version SUPA's CUDA-compatibility headers declare; the real package reads it
# from the SUDA SDK, which the emulator does not have. Code that parses torch.version.cuda needs
# a well-formed "major.minor".
CUDA_COMPAT_VERSION = "12.1"

_BANNER = (
    "transfer_to_supa is active: CUDA names now address the SUPA cards.\n"
    "  - Tensor.cuda() / Module.cuda() are Tensor.supa() / Module.supa(); tensor.is_cuda is True on SUPA\n"
    "  - torch.cuda.* and torch.cuda.amp.* are torch.supa.* and torch.supa.amp.*; torch.cuda.DoubleTensor is "
    "torch.supa.FloatTensor (SUPA has no float64)\n"
    "  - device strings 'cuda' / 'cuda:N' mean 'supa' / 'supa:N' (torch.device, device=, .to(), map_location=, "
    "torch.Generator, torch.autocast)\n"
    "  - torch.distributed backend 'nccl' means 'bccl'\n"
    "Set BRTB_TRANSFER_SILENCE=1 to hide this message."
)
_JIT_WARNING = ("torch.jit.script and torch.jit.script_method will be disabled by transfer_to_supa, "
                "which currently does not support them; scripted functions run as plain Python.")


# What the real module copies onto torch.cuda: the real torch.supa.__all__, private names
# included (docs/real_stack.md, "transfer_to_supa"). torch.cuda's other names stay CUDA's.
CUDA_NAMES = (
    # legacy storages and tensor types
    "BFloat16Storage", "BFloat16Tensor", "BoolStorage", "BoolTensor", "ByteStorage", "ByteTensor",
    "CharStorage", "CharTensor", "ComplexDoubleStorage", "ComplexFloatStorage", "DoubleStorage",
    "DoubleTensor", "FloatStorage", "FloatTensor", "HalfStorage", "HalfTensor", "IntStorage",
    "IntTensor", "LongStorage", "LongTensor", "ShortStorage", "ShortTensor",
    # streams, events, pools, graphs
    "Event", "ExternalStream", "MemPool", "MemPoolContext", "SUPAGraph", "Stream", "StreamContext",
    "current_stream", "default_stream", "set_stream", "stream", "graph", "graph_pool_handle",
    "is_current_stream_capturing", "make_graphed_callables",
    # initialisation and devices
    "_is_compiled", "_is_in_bad_fork", "_lazy_call", "_lazy_init", "_sleep", "init",
    "is_initialized", "is_available", "device_count", "current_device", "set_device", "device",
    "can_device_access_peer", "check_error", "current_blas_handle", "get_device_name",
    "get_device_properties", "is_bf16_supported", "supart", "synchronize",
    # memory
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_enable",
    "SUPAPluggableAllocator", "change_current_allocator", "empty_cache", "ipc_collect",
    "get_allocator_backend", "get_per_process_memory_fraction", "set_per_process_memory_fraction",
    "max_memory_allocated", "max_memory_cached", "max_memory_reserved", "mem_get_info",
    "memory_allocated", "memory_cached", "memory_reserved", "memory_snapshot", "memory_stats",
    "memory_stats_as_nested_dict", "memory_summary", "reset_accumulated_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached", "reset_peak_memory_stats",
    "use_mem_pool",
    # random
    "default_generators", "get_rng_state", "get_rng_state_all", "initial_seed", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all",
    # autocast
    "get_amp_supported_dtype", "get_autocast_dtype", "is_autocast_enabled", "set_autocast_dtype",
    "set_autocast_enabled",
    # submodules
    "amp", "bccl", "brtx", "profiler", "random",
)
# The real torch.supa.memory.__all__ also lists these, so torch.cuda.memory gets them too.
CUDA_MEMORY_PRIVATE_NAMES = ("_record_memory_history", "_snapshot", "_set_allocator_settings")


def _copy_names(destination: types.ModuleType, source: types.ModuleType, names=None) -> None:
    """The real `_apply_patches` rule: keep the destination module object and copy `names`
    (default: source.__all__) onto it."""
    for name in source.__all__ if names is None else names:
        setattr(destination, name, getattr(source, name))


def _rank_zero() -> bool:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def _warn_once() -> None:
    if not process_state.config().transfer_silence and _rank_zero():
        warnings.warn(_BANNER, ImportWarning)


# ---- torch.cuda answers for the SUPA cards ----------------------------------------------------

class _CudaModule(types.ModuleType):
    """torch.cuda's class after the transfer: `default_generators` and `_initialized` stay live."""

    @property
    def default_generators(self):
        return supa.default_generators

    @property
    def _initialized(self):
        return supa.is_initialized()

    def __reduce__(self):
        return "cuda"  # pickles by name, like any module attribute of torch


def _patch_cuda_namespace() -> None:
    import torch.cuda.amp.autocast_mode
    import torch.cuda.amp.common
    import torch.cuda.amp.grad_scaler
    import torch.cuda.memory
    import torch.cuda.nccl
    import torch.cuda.nvtx
    import torch.cuda.random

    from supa_emu.supa import _gpu_trace, amp, bccl, brtx, memory, random
    from supa_emu.supa.amp import autocast_mode, common, grad_scaler

    cuda = torch.cuda
    _copy_names(cuda, supa, CUDA_NAMES)
    _copy_names(cuda.memory, memory, (*memory.__all__, *CUDA_MEMORY_PRIVATE_NAMES))
    for destination, source in ((cuda.amp, amp), (cuda.random, random),
                                (cuda.amp.autocast_mode, autocast_mode), (cuda.nccl, bccl)):
        _copy_names(destination, source)
    # Modules the real package replaces wholesale (its versions have no __all__).
    for name, module in (("common", common), ("grad_scaler", grad_scaler)):
        setattr(cuda.amp, name, module)
        sys.modules[f"torch.cuda.amp.{name}"] = module
    cuda._gpu_trace = _gpu_trace
    sys.modules["torch.cuda._gpu_trace"] = _gpu_trace
    cuda.is_tf32_supported = lambda: True
    cuda.CUDAGraph = supa.SUPAGraph
    cuda.DoubleTensor = supa.FloatTensor  # SUPA has no float64
    cuda.ipc_collect = supa.ipc_collect
    # Dynamo traces `torch.cuda.device(...)` (which is supa's now) with these two.
    cuda._exchange_device = supa._exchange_device
    cuda._maybe_exchange_device = supa._maybe_exchange_device
    cuda._sleep = supa._sleep
    for name in ("range_push", "range_pop", "range_start", "range_end", "mark", "range"):
        setattr(cuda.nvtx, name, getattr(brtx, name))
    cuda.__class__ = _CudaModule
    supa.Stream.cuda_stream = supa.Stream.supa_stream
    torch.version.cuda = CUDA_COMPAT_VERSION


def _c_entry(function):
    """A distinct function object for a torch._C entry point: Dynamo's trace rules give
    torch._C._cuda_* and torch.cuda.* different treatment, so they must not be the same object."""

    @functools.wraps(function)
    def entry(*args, **kwargs):
        return function(*args, **kwargs)

    return entry


class _UnmodelledAllocatorState:
    """The allocator checkpoint of CUDA-graph trees: not modelled by the emulator."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("the SUPA emulator does not model the caching allocator's checkpoint state "
                           "(CUDA-graph trees); torch.compile mode='reduce-overhead' runs without graphs")


def _patch_torch_c() -> None:
    """The torch._C entry points CUDA code calls directly, answered by the SUPA runtime."""
    c = torch._C
    c._has_cuda = True
    c._cuda_getDeviceCount = _c_entry(supa.device_count)
    c._cuda_setDevice = _c_entry(supa.set_device)
    c._cuda_synchronize = _c_entry(supa.synchronize)
    c._cuda_getCompiledVersion = lambda: int(CUDA_COMPAT_VERSION.replace(".", "")) * 100
    c._cuda_canDeviceAccessPeer = _c_entry(supa.can_device_access_peer)
    c._cuda_hasPrimaryContext = lambda index: supa.is_initialized() and 0 <= index < supa.device_count()
    c._cuda_setStream = _c_entry(supa.set_stream_by_id)
    c._cuda_getCurrentRawStream = lambda index: supa.current_stream(index).supa_stream
    c._cuda_ipc_collect = _c_entry(supa.ipc_collect)
    c._cuda_clearCublasWorkspaces = _c_entry(supa._clear_sublas_workspaces)
    c._graph_pool_handle = _c_entry(supa.graph_pool_handle)
    from supa_emu.torch_supa import _C as supa_c

    for name in ("beginAllocateCurrentThreadToPool", "endAllocateToPool", "releasePool", "checkPoolLiveAllocations"):
        setattr(c, f"_cuda_{name}", _c_entry(getattr(supa_c, f"_supa_{name}")))
    c._host_emptyCache = _c_entry(supa_c._host_emptyCache)
    # Inductor's CUDA-graph trees import this when torch.backends.cuda.is_built() (now True);
    # the real package supplies the SUPA allocator's checkpoint state, which the emulator does
    # not model (mode="reduce-overhead" runs without graphs here).
    c._cuda_CUDAAllocator_AllocatorState = _UnmodelledAllocatorState
    c._cuda_cudaCachingAllocator_is_enabled = lambda: True  # the emulator's allocator always caches
    from supa_emu.supa import comm

    for name in comm.__all__:  # what torch.nn.DataParallel needs; a CPU build of torch lacks them
        if not hasattr(c, "_" + name):
            setattr(c, "_" + name, _c_entry(getattr(comm, name)))
    core = process_state.core()
    for name in ("_is_flash_attention_available", "_can_use_flash_attention",
                 "_can_use_mem_efficient_attention", "_can_use_cudnn_attention"):
        setattr(c, name, getattr(core, name))  # the card's SDPA choice (csrc/aten/sdp_choice.cpp)


def _patch_backends_and_profiler() -> None:
    from supa_emu import compile as compile_support
    from supa_emu.torch_supa.backends import supa as supa_backend

    # Dynamo answers "cuda" device questions (current device, streams, ...) with the SUPA
    # runtime, as the real package registers its device interface for "cuda" too.
    compile_support.register_device_interface("cuda")

    _copy_names(torch.backends.cuda, supa_backend)
    # The profiler's CUDA activity means the device activity of the SUPA backend.
    torch.profiler.ProfilerActivity.CUDA = torch.profiler.ProfilerActivity.PrivateUse1
    torch._utils._get_available_device_type = lambda: DEVICE_TYPE if supa.is_available() else None


# ---- tensors, modules, autocast, TorchScript ---------------------------------------------------

def _cuda_to_supa(value):
    if isinstance(value, str) and value.startswith("cuda"):
        return DEVICE_TYPE + value[4:]
    return value


def _rewrite_argument(function, position: int, name: str, rewrite):
    """`function` with one argument (given by position or by name) passed through `rewrite` first."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if len(args) > position:
            args = (*args[:position], rewrite(args[position]), *args[position + 1:])
        elif name in kwargs:
            kwargs[name] = rewrite(kwargs[name])
        return function(*args, **kwargs)

    return wrapper


def _wrap_device_type_argument(function, position: int = 0):
    """`function` with its device-type argument (positional or by name) mapped from cuda to supa."""
    return _rewrite_argument(function, position, "device_type", _cuda_to_supa)


def _patch_tensors_and_autocast() -> None:
    torch.Tensor.cuda = torch.Tensor.supa
    torch.Tensor.is_cuda = property(lambda self: self.is_supa, doc="True for tensors on a SUPA card")
    torch.nn.Module.cuda = torch.nn.Module.supa
    autocast = torch.amp.autocast_mode.autocast
    # The real wrapper maps positional strings only; the keyword form (device_type="cuda",
    # what most code writes) reaches the same supa autocast there through its
    # set_autocast_enabled mapping. Mapping both here gives the same result in one place.
    autocast.__init__ = _wrap_device_type_argument(autocast.__init__, position=1)
    for name in ("get_autocast_dtype", "set_autocast_dtype"):
        setattr(torch, name, _wrap_device_type_argument(getattr(torch, name)))
    torch.is_autocast_enabled = _default_device_supa(_wrap_device_type_argument(torch.is_autocast_enabled))
    torch.set_autocast_enabled = _default_device_supa(_wrap_device_type_argument(torch.set_autocast_enabled))
    # custom_fwd(cast_inputs=..., device_type="cuda") casts the tensors whose device type is the
    # one named; its helper is looked up at call time, so decorators made before the transfer map too.
    autocast_mode = torch.amp.autocast_mode
    autocast_mode._cast = _wrap_device_type_argument(autocast_mode._cast, position=1)
    if not process_state.config().transfer_silence:
        warnings.warn(_JIT_WARNING, RuntimeWarning)
    torch.jit.script = _identity(torch.jit.script)
    torch.jit.script_method = _identity(torch.jit.script_method)


def _default_device_supa(function):
    """The legacy forms without a device type (`is_autocast_enabled()`, `set_autocast_enabled(True)`)
    meant CUDA; after the transfer they mean the SUPA card."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if not any(isinstance(a, str) for a in args) and "device_type" not in kwargs:
            args = (DEVICE_TYPE, *args)
        return function(*args, **kwargs)

    return wrapper


def _identity(original):
    @functools.wraps(original)
    def identity(obj, *args, **kwargs):
        return obj

    return identity


# ---- torch.serialization: checkpoints of CUDA machines load onto the SUPA cards ----------------

def _restore_cuda_location(storage, location: str):
    if location.startswith("cuda"):
        return torch.serialization._deserialize("privateuse1", storage, DEVICE_TYPE + location[4:])
    return None


def _patch_serialization() -> None:
    # Priority 19 runs before CUDA's own deserializer (20), which would reject a supa device.
    torch.serialization.register_package(19, lambda storage: None, _restore_cuda_location)


# ---- torch.distributed: "nccl" means "bccl" -----------------------------------------------------

def _nccl_to_bccl(backend):
    if not isinstance(backend, str):
        return backend
    # "nccl" alone, or inside a device map like "cpu:gloo,cuda:nccl" (whose "cuda" is the supa card).
    return backend.replace("cuda:", "supa:").replace("nccl", "bccl")


def _patch_distributed() -> None:
    from torch.distributed import constants, device_mesh, distributed_c10d

    from supa_emu.distributed import is_registered

    for name, position in (("init_process_group", 0), ("new_group", 2), ("new_subgroups", 3),
                           ("new_subgroups_by_enumeration", 2)):
        wrapped = _rewrite_argument(getattr(distributed_c10d, name), position, "backend", _nccl_to_bccl)
        setattr(distributed_c10d, name, wrapped)
        setattr(dist, name, wrapped)
    # Only the public name: c10d's own NCCL-only paths (ephemeral timeouts, ...) test its module
    # global and then call ProcessGroupNCCL methods, which bccl groups do not have.
    dist.is_nccl_available = is_registered
    dist.ProcessGroupNCCL = ProcessGroupBCCL
    constants.default_pg_nccl_timeout = DEFAULT_TIMEOUT
    distributed_c10d.default_pg_nccl_timeout = DEFAULT_TIMEOUT
    mesh = device_mesh.DeviceMesh
    mesh.__init__ = _wrap_device_type_argument(mesh.__init__, position=1)


def _apply() -> None:
    warnings.filterwarnings(action="once")  # the real module sets this process-wide filter too
    _warn_once()
    _patch_cuda_namespace()
    supa._native()._set_cuda_means_supa(True)
    _patch_torch_c()
    _patch_backends_and_profiler()
    _patch_tensors_and_autocast()
    _patch_serialization()
    _patch_distributed()


_apply()
