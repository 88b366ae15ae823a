"""PinMemoryBuilder: DeepSpeed's page-locked host allocator (used by aio and offload), built from its C++ sources."""

import sys

from . import builder


class PinMemoryBuilder(builder.SUPAOpBuilder):
    BUILD_VAR = "DS_BUILD_PIN_MEMORY"
    NAME = "pin_memory"

    def absolute_name(self):
        return f'deepspeed.ops.pin_memory.{self.NAME}_op'

    def is_compatible(self, verbose=False):
        # posix_memalign / mlock: POSIX only.
        if sys.platform == "win32":
            if verbose:
                self.warning(f"{self.NAME} needs a POSIX host (posix_memalign/mlock); Windows is not supported.")
            return False
        return super().is_compatible(verbose)

    def sources(self):
        return ['csrc/pin_memory/page_alloc.cpp', 'csrc/pin_memory/deepspeed_pin_tensor.cpp',
                'csrc/pin_memory/py_ds_pin_memory.cpp']

    def include_paths(self):
        return ['csrc/pin_memory']

    def cxx_args(self):
        # DeepSpeed's own pin_memory builder passes no flags; the same (empty) flags let both
        # accelerators share one build (see builder.SUPAOpBuilder).
        return []

    def load(self, verbose=False):
        # DeepSpeed keeps one process-wide pin_memory module, loaded RTLD_GLOBAL, because the aio
        # extension resolves the shared pin manager's symbols from it; share that cache.
        from deepspeed.ops.op_builder.pin_memory_load import load_pin_memory_module
        return load_pin_memory_module(self, verbose=verbose)
