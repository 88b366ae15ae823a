"""Inductor backend for `supa`: PyTorch's CPU C++ kernels run directly on the host memory of
emulated SUPA tensors; the wrapper allocates its buffers on the supa card they belong to.

The kernels Inductor generates for the CPU take raw data pointers, and an emulated card's
memory is host memory, so the kernels are the CPU's, generated as for the CPU. What differs
from the CPU wrapper is where buffers come from: `empty_strided(..., device=supa:N)`, so every
byte the compiled code allocates goes through the emulator's caching allocator (accounting and
capacity stay exact). There are no device guards or streams to emit (Inductor emits them for
GPU device types only, and supa is not one): the emulator executes synchronously and every
allocation names its card; extern kernels (aten.mm, ...) dispatch on their supa operands.
"""

from __future__ import annotations

import torch
from torch._inductor.codegen import cpp_wrapper_cpu
from torch._inductor.codegen.common import DeviceOpOverrides, register_device_op_overrides
from torch._inductor.codegen.cpp import CppScheduling
from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
from torch._inductor.codegen.wrapper_fxir import WrapperFxCodegen
from torch._inductor.virtualized import V

from supa_emu.compile import flex_attention, inductor_patches
from supa_emu.device_type import DEVICE_TYPE
_CPU = torch.device("cpu")


class SupaScheduling(CppScheduling):
    """CPU C++ kernels (vectorised, OpenMP) for nodes placed on supa cards.

    Kernel generation runs with the graph's current device set to the CPU: the C++ code
    generator and the helpers it calls pick their dialect from that device (`cpp` for the CPU,
    Triton for any other device type), and the kernel call they emit is the CPU one. Buffers
    keep their supa layout, so allocations and the kernels' callers are unaffected.
    """

    def codegen_node(self, node):
        with V.graph.set_current_device(_CPU):
            return super().codegen_node(node)

    def codegen_template(self, *args, **kwargs):
        with V.graph.set_current_device(_CPU):
            return super().codegen_template(*args, **kwargs)

    def flush(self):
        with V.graph.set_current_device(_CPU):
            return super().flush()


# How the C++ code generator spells a device-side check (`ops.device_assert_async`) in a kernel.
_DEVICE_CHECK = "(throw std::runtime_error("


def _root_wrapper(wrapper):
    while getattr(wrapper, "parent_wrapper", None) is not None:
        wrapper = wrapper.parent_wrapper
    return wrapper


class _SupaWrapperMixin:
    """What the supa wrapper changes in PyTorch's Python wrapper: where buffers are allocated, and
    that the generated C++ kernels are called through `generated_kernels.run`, which asks the
    planner's mode at each call."""

    def _define_kernel_helper(self, kernel_name, kernel_body, metadata=None, gpu=True, cpp_definition=None):
        if not gpu and _DEVICE_CHECK in kernel_body:
            root = _root_wrapper(self)
            root.supa_checked_kernels = getattr(root, "supa_checked_kernels", set()) | {kernel_name}
        return super()._define_kernel_helper(kernel_name, kernel_body, metadata,  # type: ignore[misc]
                                             gpu, cpp_definition)

    def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, triton=True, arg_types=None,
                                     **kwargs):
        device = device or V.graph.get_current_device_or_throw()
        if triton or device.type != "cpu" or arg_types is None:
            return super()._generate_kernel_call_helper(  # type: ignore[misc]
                kernel_name, call_args, device=device, triton=triton, arg_types=arg_types, **kwargs)
        # The C++ kernel's non-const pointers are what it writes.
        written = tuple(i for i, kind in enumerate(arg_types)
                        if isinstance(kind, str) and kind.endswith("*") and not kind.startswith("const "))
        checked = kernel_name in getattr(_root_wrapper(self), "supa_checked_kernels", ())
        check = repr(f"aten::_assert_async (compiled into {kernel_name})") if checked else None
        self.writeline(f"run_generated_kernel({kernel_name}, {written!r}, {check}, {', '.join(call_args)})")

    def make_allocation(self, name, device, dtype, shape, stride, allocation_shape=None,
                        is_pinned=False):
        if device.type != DEVICE_TYPE:
            return super().make_allocation(name, device, dtype, shape, stride,  # type: ignore[misc]
                                           allocation_shape, is_pinned)
        if allocation_shape is None:
            allocation_shape = shape
        size = self.codegen_python_shape_tuple(allocation_shape)  # type: ignore[attr-defined]
        strides = self.codegen_python_shape_tuple(stride)  # type: ignore[attr-defined]
        line = (f"{name} = empty_strided({size}, {strides}, "
                f"device=device(type='{DEVICE_TYPE}', index={device.index}), dtype={dtype})")
        view = self.codegen_python_shape_tuple(shape)  # type: ignore[attr-defined]
        if view != size:
            line += f".as_strided({view}, {strides})"
        return line


class SupaPythonWrapperCodegen(_SupaWrapperMixin, PythonWrapperCodegen):
    def write_header(self) -> None:
        super().write_header()
        self.imports.writeline("from supa_emu.compile.generated_kernels import run as run_generated_kernel")

    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            return SupaSubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper,
                                                    partition_signatures)
        return SupaPythonWrapperCodegen()


class SupaSubgraphPythonWrapperCodegen(_SupaWrapperMixin, SubgraphPythonWrapperCodegen):
    pass


class SupaCppWrapperCodegen(cpp_wrapper_cpu.CppWrapperCpu):
    """The C++ wrapper (`cpp_wrapper=True`, AOTInductor): not available for supa; says so."""

    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        raise NotImplementedError(
            "torch._inductor.config.cpp_wrapper=True (and AOTInductor) is not supported on emulated "
            "SUPA cards: the emulator's Inductor backend generates the Python wrapper only. "
            "Compile with cpp_wrapper=False (the default).")


class SupaDeviceOpOverrides(DeviceOpOverrides):
    """Device statements the wrapper may emit for supa, spelled with `torch.supa`."""

    def import_get_raw_stream_as(self, name: str) -> str:
        return (f"def {name}(index):\n"
                f"    return torch.supa.current_stream(index).supa_stream\n")

    def set_device(self, device_idx: int) -> str:
        return f"torch.supa.set_device({device_idx})"

    def synchronize(self) -> str:
        return "torch.supa.synchronize()"

    def device_guard(self, device_idx: int) -> str:
        return f"torch.supa._DeviceGuard({device_idx})"

    def cpp_kernel_type(self) -> str:
        return "void*"


# Served to Inductor's PrivateUse1 lookup (`torch.supa.<name>`, see supa_emu.compile).
CODEGEN_CLASSES = {
    "Scheduling": SupaScheduling,
    "PythonWrapperCodegen": SupaPythonWrapperCodegen,
    "CppWrapperCodegen": SupaCppWrapperCodegen,
    "WrapperFxCodegen": WrapperFxCodegen,
}

register_device_op_overrides(DEVICE_TYPE, SupaDeviceOpOverrides())
inductor_patches.apply()
flex_attention.install()
