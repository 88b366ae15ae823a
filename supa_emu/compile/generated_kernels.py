"""How compiled code on supa calls the C++ kernels Inductor generated for it.

In compute mode a call is the kernel's. In the planner's shapes mode (docs/shapes_mode.md) a
compiled region allocates its buffers as its wrapper says (`empty_strided` on the card, Inductor's
reuse) and its extern kernels (matrix products, attention) take their shape rules through the
operator fallback like any operator; a generated kernel runs only where an operator in its place
would (`_shapes_generated_kernel_runs`, supa_emu/csrc/aten/shape_only.h): small operands, or integer
and boolean results of values the card holds. What it writes then holds values only where it ran on
operands that hold them, so a later `.item()` or check of them is reported as value-dependent.

The mode is asked at each call, not when the code is generated: Inductor's on-disk cache hands the
code compiled in one mode to a process of the other.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from supa_emu import process_state, shapes

_core = process_state.core()
_SHAPES = shapes.mode() == "shapes"


def run(kernel, written: tuple, check: str | None, *args) -> None:
    """Calls the generated `kernel` with `args` (tensors and sizes), whose positions `written` it
    writes; `check` names the device-side check compiled into it (`torch._assert_async`), if any."""
    for arg in args:
        if type(arg) is FakeTensor:
            _refuse_fake()
    if not _SHAPES:
        kernel(*args)
        return
    operands = [arg for arg in args if isinstance(arg, torch.Tensor)]
    outputs = [args[i] for i in written]
    ran = _core._shapes_generated_kernel_runs(operands, outputs)
    if ran:
        # Reads before the kernel writes: an operand it writes may be one it reads.
        unknown = _core._shapes_values_unknown(operands)
        kernel(*args)
    else:
        unknown = True
        if check is not None:
            _core._shapes_note_skipped_check(check)
    _core._shapes_note_values(outputs, unknown)


def _refuse_fake() -> None:
    # A fake tensor has no memory: the kernel would read and write through a null pointer and take
    # the process down. Compiled code meets them when Dynamo compiles a frame that runs under
    # FakeTensorMode (its buffers are then fake too), e.g. a graph break inside PyTorch's own
    # flex attention autograd, which builds its graphs on fake tensors.
    raise RuntimeError("compiled code on supa called one of its generated kernels with fake tensors "
                       "(FakeTensorMode was active: torch.compile compiled a function that runs while "
                       "tracing); a kernel needs tensors with memory. Compile the calling function "
                       "instead, or keep the call out of torch.compile")
