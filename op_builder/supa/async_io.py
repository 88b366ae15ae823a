"""AsyncIOBuilder: DeepSpeed's libaio-based NVMe/file I/O (ZeRO-Infinity), built from its host C++ sources."""

from . import builder
from .pin_memory import PinMemoryBuilder as _PinMemory  # noqa: N814  (kept out of DeepSpeed's *Builder scan)

_INSTALL_HINT = ("install the libaio development files (Debian/Ubuntu: `apt-get install libaio-dev`; "
                 "RHEL/Fedora: `yum install libaio-devel`), or point CFLAGS/LDFLAGS at a libaio build")


class AsyncIOBuilder(builder.SUPAOpBuilder):
    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"

    def absolute_name(self):
        return f'deepspeed.ops.aio.{self.NAME}_op'

    # Sources, include paths and flags as DeepSpeed's built-in SUPA AsyncIOBuilder has them, so the
    # two accelerators share one build (see builder.SUPAOpBuilder).
    def sources(self):
        return [
            'csrc/aio/py_lib/deepspeed_py_copy.cpp', 'csrc/aio/py_lib/py_ds_aio.cpp',
            'csrc/aio/py_lib/deepspeed_py_aio.cpp', 'csrc/aio/py_lib/deepspeed_py_aio_handle.cpp',
            'csrc/aio/py_lib/deepspeed_aio_thread.cpp', 'csrc/aio/common/deepspeed_aio_utils.cpp',
            'csrc/aio/common/deepspeed_aio_common.cpp', 'csrc/aio/common/deepspeed_aio_types.cpp',
            'csrc/aio/py_lib/deepspeed_pin_tensor_client.cpp', 'csrc/aio/py_lib/deepspeed_py_io_handle.cpp',
            'csrc/aio/py_lib/deepspeed_cpu_op.cpp', 'csrc/aio/py_lib/deepspeed_aio_op_desc.cpp'
        ]

    def include_paths(self):
        return ['csrc/aio/py_lib', 'csrc/aio/common', 'csrc/pin_memory']

    def cxx_args(self):
        # I/O bound: optimisation buys nothing, debuggability does.
        return [arg for arg in super().cxx_args() if not arg.startswith('-O')] + ['-O0', '-Wall', '-shared', '-fPIC']

    def extra_ldflags(self):
        return ['-laio']

    def _libaio_found(self):
        # Compile and link a program calling io_submit: the only test that covers headers and library.
        return self.has_function('io_submit', ('aio', ))

    def is_compatible(self, verbose=False):
        if not self._libaio_found():
            self.error_log = f"{self.NAME} needs libaio, which was not found: {_INSTALL_HINT}"
            if verbose:
                self.warning(self.error_log)
            return False
        return super().is_compatible(verbose)

    def load(self, verbose=False):
        if not self.is_compatible(verbose):
            raise RuntimeError(f"Cannot build DeepSpeed's {self.NAME} op for SUPA: libaio was not found; "
                               f"{_INSTALL_HINT}.")
        # The aio extension resolves the pin manager's symbols from the pin_memory module.
        _PinMemory().load(verbose=verbose)
        return super().load(verbose=verbose)
