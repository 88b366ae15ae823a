"""Base classes shared by the SUPA op builders: host C++ builds and Python-only op modules.

Other modules import this module (`from . import builder`), never the classes by name: DeepSpeed
treats every module attribute whose name ends in `Builder` as an op builder to instantiate, and the
bases below are not ops.
"""

import types

from deepspeed.ops.op_builder.builder import OpBuilder

from . import supa_kernels


class SUPAOpBuilder(OpBuilder):
    """An op compiled from host C++ with `CppExtension` (the SUPA runtime needs no device compiler).

    Source paths are relative to the installed `deepspeed/ops` directory, as for every DeepSpeed
    builder, so DeepSpeed's own JIT loader (`OpBuilder.load`) builds them.
    """

    BUILD_VAR = None
    NAME = None

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        return f"deepspeed.ops.{self.NAME}_op"

    def sources(self):
        return []

    def builder(self):
        import os
        from torch.utils.cpp_extension import CppExtension
        include_dirs = [os.path.abspath(self.deepspeed_src_path(p)) for p in self.strip_empty_entries(self.include_paths())]
        return CppExtension(name=self.absolute_name(),
                            sources=self.strip_empty_entries(self.sources()),
                            include_dirs=include_dirs,
                            extra_compile_args={'cxx': self.strip_empty_entries(self.cxx_args())},
                            extra_link_args=self.strip_empty_entries(self.extra_ldflags()))

    # The build flags below equal those of DeepSpeed's built-in SUPA builders on purpose. Both
    # accelerators JIT-build an op under the same name into the same torch-extensions directory;
    # torch's build there is driven by ninja, which recompiles whenever the compile command
    # changes. With different flags, every switch of SUPA_DS_ACCELERATOR rebuilt cpu_adam & co.
    # (about two minutes each); with the same flags, whichever accelerator builds first serves both.
    def cxx_args(self):
        # The host kernels (cpu_adam & co.) pick their SIMD path from these macros.
        return ['-O3', '-std=c++17', '-g', '-Wno-reorder', '-fopenmp', self.cpu_arch(), self.simd_width()]

    def extra_ldflags(self):
        return []  # libgomp comes with libtorch_cpu, which every extension links

    def jit_load(self, verbose=True):
        """DeepSpeed's JIT build, saying when it compiles (it is silent otherwise for minutes)."""
        import time
        library = _extension_library(self.name)
        before = _mtime(library)
        if before is None:
            _say(f"building DeepSpeed's {self.name} op for SUPA (once; cached in {library.parent}); "
                 f"this takes a minute or two")
        start = time.monotonic()
        module = super().jit_load(verbose)
        if _mtime(library) != before:
            _say(f"built DeepSpeed's {self.name} op in {time.monotonic() - start:.0f} s")
        return module


def _say(message):
    import sys
    print(f"{__package__}: {message}", file=sys.stderr, flush=True)


def _extension_library(name):
    """Where torch's JIT build puts the library of extension `name`."""
    import pathlib
    from torch.utils import cpp_extension
    return pathlib.Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"


def _mtime(path):
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class SUPAPythonOpBuilder(SUPAOpBuilder):
    """An op implemented in Python: `load()` returns a module object; nothing is compiled."""

    def ops(self):
        """Return {attribute name: callable} for the loaded module."""
        raise NotImplementedError

    def load(self, verbose=False):
        if not self.is_compatible(verbose):
            raise RuntimeError(f"Unable to load the {self.name} op on SUPA: {self.error_log}")
        module = types.ModuleType(f"{__package__}.{self.NAME}_op", f"SUPA {self.NAME} ops")
        for attr, fn in self.ops().items():
            setattr(module, attr, fn)
        return module

    def jit_load(self, verbose=True):
        return self.load(verbose)


class SUPAOpUnavailable(AttributeError, NotImplementedError):
    """A DeepSpeed op with no SUPA operator behind it.

    An AttributeError so DeepSpeed's `try: module.op except AttributeError: <PyTorch fallback>`
    pattern takes its fallback; a NotImplementedError for everyone else.
    """


class SUPAExtensionOpBuilder(SUPAPythonOpBuilder):
    """An op module whose functions are torch_supa_ext's `torch.ops.deepspeed.*` operators.

    OPS maps each function name DeepSpeed's Python code calls to the operator torch_supa_ext
    registers for it (None: no such operator). torch_supa_ext merged DeepSpeed's per-dtype
    functions (`softmax_fp16`, `softmax_bf16`, ...) into one operator (`softmax`) with the same
    arguments, so several names can share an operator. Operators registered as stubs are returned
    as they are: calling one raises torch_supa_ext's own NotImplementedError naming it.
    """

    OPS = {}

    def _missing(self):
        return sorted({op for op in self.OPS.values() if op is not None and supa_kernels.registered_op(op) is None})

    def is_compatible(self, verbose=False):
        ok, why = supa_kernels.extension_status()
        if ok:
            missing = self._missing()
            if missing:
                ok, why = False, f"torch_supa_ext does not register deepspeed:: {', '.join(missing)}"
        if not ok:
            self.error_log = f"{self.NAME} on SUPA needs torch_supa_ext's compiled kernels: {why}"
            if verbose:
                self.warning(self.error_log)
        return ok

    def load(self, verbose=False):
        ok, why = supa_kernels.extension_status()
        if not ok:
            raise ImportError(f"DeepSpeed op '{self.NAME}' on SUPA needs torch_supa_ext's compiled kernels: {why}")
        module = types.ModuleType(f"{__package__}.{self.NAME}_op", f"SUPA {self.NAME} ops (torch_supa_ext)")
        unavailable = {}
        for attr, op_name in self.OPS.items():
            op = supa_kernels.registered_op(op_name) if op_name is not None else None
            if op is not None:
                setattr(module, attr, op)
            elif op_name is None:
                unavailable[attr] = f"DeepSpeed op '{attr}' ({self.NAME}) has no SUPA kernel: torch_supa_ext has no operator for it"
            else:
                unavailable[attr] = (f"DeepSpeed op '{attr}' ({self.NAME}) has no SUPA kernel: "
                                     f"torch.ops.deepspeed.{op_name} is not registered by torch_supa_ext")
        for attr, value in self.constants().items():
            setattr(module, attr, value)

        def __getattr__(attr):
            if attr in unavailable:
                raise SUPAOpUnavailable(unavailable[attr])
            raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")

        module.__getattr__ = __getattr__
        return module

    def constants(self):
        """Non-callable attributes of the module (enums DeepSpeed reads)."""
        return {}
