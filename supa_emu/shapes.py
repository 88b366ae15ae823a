"""The planner's shapes mode as Python sees it: which mode this process runs in, and the native
core's notes on the operators that still ran their kernels (see supa_emu/csrc/aten/shape_only.h).

In shapes mode an operator on supa tensors takes its results from PyTorch's shape rule and runs
no kernel, except where the rule cannot tell the results: operators whose output shape depends on
the values (`nonzero`, `masked_select`, `unique`, indexing with a mask) and the few without a shape
rule run their kernels on the values the card holds, and are noted here with their first call site.
So are reads (`.item()`) and device-side checks (`_assert_async`, skipped, also where compiled into a
kernel of torch.compile's) of values the plan did not compute. Integer and boolean results of values the card holds are computed, whatever their size.
"""

from __future__ import annotations

from supa_emu import process_state

VALUE_DEPENDENT = "value-dependent"
NO_SHAPE_RULE = "no shape rule"


_READS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}


def value_dependent_kind(op: str) -> str:
    """What a value-dependent call noted as `op` ("aten::name[.overload]", or "aten::_assert_async
    (compiled into KERNEL)" for a check in a compiled kernel that did not run) did: "read" (its result
    is the values), "check" (a device-side assertion, skipped) or "shape" (its output's shape)."""
    name = op.split(" ")[0].split(".")[0]
    if name in _READS:
        return "read"
    return "check" if name == "aten::_assert_async" else "shape"


def mode() -> str:
    """'shapes' or 'compute' (every kernel runs), as SUPA_PLAN_MODE chose at activation."""
    return process_state.config().plan_mode


def notes() -> list[dict]:
    """[{kind (VALUE_DEPENDENT or NO_SHAPE_RULE), op, count, frames of the first call (innermost
    first)}]; empty in compute mode."""
    return list(process_state.core()._shapes_notes())
