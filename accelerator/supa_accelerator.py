"""DeepSpeed's accelerator interface for Biren SUPA GPUs, implemented on `torch.supa`, one method per interface method in the interface's order.

Every answer comes from `torch.supa.*` or public torch APIs, so the class behaves the same on a
real card and on anything else that provides `torch.supa` (such as this project's emulator).
What a device can do (dtypes, graphs, triton, profiler ranges) is probed, never assumed.
"""

import functools
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import threading
import types
import warnings

import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

_DEVICE_TYPE = "supa"
# The op builders for SUPA: the `op_builder/supa` package that sits beside this one's folder
# (`op_builder.supa` in DeepSpeed's tree, `supa_deepspeed.op_builder.supa` when installed).
_OP_BUILDER_PACKAGE = ".".join(filter(None, [__package__.rpartition(".")[0], "op_builder", "supa"]))


def _supa():
    """The `torch.supa` device module, or a clear error when no SUPA runtime registered it."""
    supa = getattr(torch, _DEVICE_TYPE, None)
    if supa is None:
        raise RuntimeError("torch.supa is not registered: the SUPA accelerator needs torch_supa, "
                           "which provides PyTorch's 'supa' device")
    return supa


class SUPA_Accelerator(DeepSpeedAccelerator):

    def __init__(self):
        self._name = _DEVICE_TYPE
        self._communication_backend_name = "bccl" if sys.platform != "win32" else "gloo"
        self._compile_backend = "inductor"
        self._probed = {}  # capability name -> bool, filled on first question
        self._builders = None  # op builder class name -> class, filled on first lookup
        self._builders_lock = threading.Lock()

    def is_synchronized_device(self):
        # SUPA kernels run asynchronously on streams; ordering goes through streams and events.
        return False

    def use_host_timers(self):
        return self.is_synchronized_device()

    def resolves_data_dependency(self):
        return self.is_synchronized_device()

    def handles_memory_backpressure(self):
        return self.is_synchronized_device()

    # Device APIs
    def device_name(self, device_index=None):
        if device_index is None:
            return _DEVICE_TYPE
        return f"{_DEVICE_TYPE}:{device_index}"

    def communication_backend_version(self):
        # As the CUDA accelerator answers with NCCL's: DeepSpeed gates features on it.
        return _supa().bccl.version()

    def device(self, device_index=None):
        return torch.device(_DEVICE_TYPE, device_index)

    def set_device(self, device_index):
        _supa().set_device(device_index)

    def current_device(self):
        return _supa().current_device()

    def current_device_name(self):
        return f"{_DEVICE_TYPE}:{self.current_device()}"

    def device_count(self):
        return _supa().device_count()

    def synchronize(self, device_index=None):
        return _supa().synchronize(device_index)

    # RNG APIs
    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None):
        if device_index is None:
            return _supa().set_rng_state(new_state)
        return _supa().set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index=None):
        if device_index is None:
            return _supa().get_rng_state()
        return _supa().get_rng_state(device_index)

    def manual_seed(self, seed):
        return _supa().manual_seed(seed)

    def manual_seed_all(self, seed):
        return _supa().manual_seed_all(seed)

    def initial_seed(self):
        return _supa().initial_seed()

    def default_generator(self, device_index):
        supa = _supa()
        # default_generators stays empty until the runtime is initialised.
        supa.init()
        return supa.default_generators[device_index]

    # Streams/Events
    @property
    def Stream(self):
        return _supa().Stream

    def stream(self, stream):
        return _supa().stream(stream)

    def current_stream(self, device_index=None):
        return _supa().current_stream(device_index)

    def default_stream(self, device_index=None):
        return _supa().default_stream(device_index)

    @property
    def Event(self):
        return _supa().Event

    # Memory management
    def empty_cache(self):
        return _supa().empty_cache()

    def memory_allocated(self, device_index=None):
        return _supa().memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None):
        return _supa().max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        # torch.supa's reset_max_memory_allocated is a deprecated alias that warns on every call
        # and resets all peaks anyway; DeepSpeed calls it often, so go to the real function.
        return _supa().reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index=None):
        # "cached" is the old name of "reserved"; the alias only adds a deprecation warning.
        return _supa().memory_reserved(device_index)

    def max_memory_cached(self, device_index=None):
        return _supa().max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index=None):
        return _supa().reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index=None):
        return _supa().memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index=None):
        return _supa().reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None):
        return _supa().memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None):
        return _supa().max_memory_reserved(device_index)

    def total_memory(self, device_index=None):
        return _supa().get_device_properties(device_index).total_memory

    def available_memory(self, device_index=None):
        # What the device can still hand out: blocks held by the caching allocator and memory
        # used by other processes are not available, so `total - allocated` would overstate it.
        free, _total = _supa().mem_get_info(device_index)
        return free

    # Data types
    def is_bf16_supported(self):
        if not self.is_available():
            return False
        return bool(_supa().is_bf16_supported())

    def is_fp16_supported(self):
        return self._probe("fp16", lambda: self._computes_on_device(torch.float16))

    def is_fp64_supported(self):
        # Not abstract in the interface, but SUPA cards may lack float64: host->device copies of
        # float64 data either fail or are demoted to float32 with a warning. Either way: no.
        return self._probe("fp64", self._keeps_float64)

    def supported_dtypes(self):
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def _probe(self, capability, check):
        # Probes run once per accelerator; a device without SUPA cards supports nothing.
        if capability not in self._probed:
            self._probed[capability] = self.is_available() and bool(check())
        return self._probed[capability]

    def _computes_on_device(self, dtype):
        try:
            x = torch.ones(2, dtype=dtype, device=self.device())
            return bool((x + x).eq(2).all().item())
        except (RuntimeError, TypeError):
            return False

    def _keeps_float64(self):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                x = torch.ones(2, dtype=torch.float64).to(self.device())
                return x.dtype == torch.float64 and bool((x + x).eq(2).all().item())
        except (RuntimeError, TypeError, Warning):
            return False

    # Misc
    def is_available(self):
        supa = getattr(torch, _DEVICE_TYPE, None)
        return supa is not None and bool(supa.is_available())

    def range_push(self, msg, domain=None, category=None):
        # brtx (SUPA's NVTX) has no domains or categories; they are accepted and ignored.
        brtx = self._brtx()
        if brtx is not None:
            try:
                return brtx.range_push(msg)
            except RuntimeError:
                # Raised on every call when the BRTX library is not installed: stop asking.
                self._probed["brtx"] = False

    def range_pop(self, domain=None):
        brtx = self._brtx()
        if brtx is not None:
            try:
                return brtx.range_pop()
            except RuntimeError:
                self._probed["brtx"] = False

    def _brtx(self):
        if self._probed.get("brtx", True):
            return getattr(getattr(torch, _DEVICE_TYPE, None), "brtx", None)
        return None

    def lazy_call(self, callback):
        return _supa()._lazy_call(callback)

    def communication_backend_name(self):
        return self._communication_backend_name

    def is_triton_supported(self):
        return self._probe("triton", self._triton_targets_supa)

    @staticmethod
    def _triton_targets_supa():
        if importlib.util.find_spec("triton") is None:
            return False
        try:
            from triton.runtime import driver
            return driver.active.get_current_target().backend == _DEVICE_TYPE
        except Exception:
            # Triton raises assorted errors when it finds no usable driver; all mean "no".
            return False

    # Graph operations
    def is_current_stream_capturing(self) -> bool:
        capturing = getattr(_supa(), "is_current_stream_capturing", None)
        return bool(capturing()) if capturing is not None else False

    def create_graph(self):
        return self._graph_api("SUPAGraph")()

    def capture_to_graph(self, graph, pool=None, stream=None):
        return self._graph_api("graph")(graph, pool, stream)

    def replay_graph(self, graph):
        graph.replay()
        return

    @staticmethod
    def _graph_api(name):
        api = getattr(_supa(), name, None)
        if api is None:
            # A silent eager fallback would leave the captured outputs stale on replay.
            raise RuntimeError(f"torch.supa.{name} is missing: this SUPA runtime does not support graph capture")
        return api

    # Tensor operations
    @property
    def BFloat16Tensor(self):
        return functools.partial(torch.tensor, dtype=torch.bfloat16, device=_DEVICE_TYPE)

    @property
    def ByteTensor(self):
        return functools.partial(torch.tensor, dtype=torch.uint8, device=_DEVICE_TYPE)

    @property
    def DoubleTensor(self):
        return functools.partial(torch.tensor, dtype=torch.double, device=_DEVICE_TYPE)

    @property
    def FloatTensor(self):
        return functools.partial(torch.tensor, dtype=torch.float, device=_DEVICE_TYPE)

    @property
    def HalfTensor(self):
        return functools.partial(torch.tensor, dtype=torch.half, device=_DEVICE_TYPE)

    @property
    def IntTensor(self):
        return functools.partial(torch.tensor, dtype=torch.int, device=_DEVICE_TYPE)

    @property
    def LongTensor(self):
        return functools.partial(torch.tensor, dtype=torch.long, device=_DEVICE_TYPE)

    # Memory pinning
    # The interface's public pin_memory / pin_empty / is_pinned route through DeepSpeed's native
    # pinning backend when one is configured (DS_PIN_MEMORY_BACKEND) and otherwise through these
    # torch primitives. torch pins for the current accelerator, which is SUPA once torch.supa is
    # registered, so page-locked buffers come from SUPA's host allocator.
    def _torch_pin_memory(self, tensor):
        return tensor.pin_memory()

    def _torch_empty_pinned(self, tensor, shape):
        return tensor.new_empty(shape, pin_memory=True)

    def _torch_is_pinned(self, tensor):
        return tensor.is_pinned()

    def on_accelerator(self, tensor):
        return tensor.device.type == _DEVICE_TYPE

    def op_builder_dir(self):
        return _OP_BUILDER_PACKAGE

    def create_op_builder(self, class_name):
        builder_class = self.get_op_builder(class_name)
        return None if builder_class is None else builder_class()

    def get_op_builder(self, class_name):
        builders = self._builder_classes()
        if class_name in builders:
            return builders[class_name]
        fallback = builders.get("NotImplementedBuilder")
        if fallback is None:
            return None
        with self._builders_lock:
            if class_name not in builders:
                builders[class_name] = self._named_fallback(class_name, fallback)
        return builders[class_name]

    def _builder_classes(self):
        if self._builders is None:
            with self._builders_lock:
                if self._builders is None:
                    self._builders = self._scan_builders(self.op_builder_dir())
        return self._builders

    @staticmethod
    def _scan_builders(package_name):
        """{name: class} of every concrete op builder class in the package and its modules."""
        package = importlib.import_module(package_name)
        modules = [package]
        for info in pkgutil.iter_modules(package.__path__):
            if not info.ispkg:
                modules.append(importlib.import_module(f"{package_name}.{info.name}"))
        found = {}
        for module in modules:
            for name, value in vars(module).items():
                # Bases such as OpBuilder / SUPAOpBuilder end in "OpBuilder" and are not ops.
                if (name.endswith("Builder") and not name.endswith("OpBuilder") and inspect.isclass(value)
                        and not inspect.isabstract(value)):
                    found.setdefault(name, value)
        return found

    @staticmethod
    def _named_fallback(class_name, fallback):
        # A builder DeepSpeed asks for but SUPA lacks: a NotImplementedBuilder subclass carrying the
        # requested name, so the builder's error can say which op is missing.
        named = types.new_class(class_name, (fallback, ))
        named.__module__ = fallback.__module__
        named.__doc__ = f"{class_name} is not available on SUPA; loading it raises NotImplementedError."
        return named

    def build_extension(self):
        from torch.utils.cpp_extension import BuildExtension
        return BuildExtension

    def export_envs(self):
        # Prefixes of the variables the DeepSpeed launcher forwards to every rank.
        return ["BCCL", "BIREN", "SUPA", "LD_LIBRARY", "PATH"]

    def visible_devices_envs(self):
        return ["SUPA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env, local_accelerator_ids):
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def get_compile_backend(self):
        return self._compile_backend

    def set_compile_backend(self, backend):
        supported_backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported_backends:
            raise ValueError(f"{backend} not supported by {self.device_name()}. "
                             f"Supported Backends are {supported_backends}")
        self._compile_backend = backend
