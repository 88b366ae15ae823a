"""The planner's shapes mode as Python sees it: which mode this process runs in, and the native
core's notes on the operators that still ran their kernels (see supa_emu/csrc/aten/shape_only.h).

In shapes mode an operator on supa tensors takes its results from PyTorch's shape rule and runs
no kernel, except where the rule cannot tell the results: operators whose output shape depends on
the values (`nonzero`, `masked_select`, `unique`, indexing with a mask) and the few without a shape
rule run their kernels on the values the card holds, and are noted here with their first call site.
"""

from __future__ import annotations

from supa_emu import process_state

VALUE_DEPENDENT = "value-dependent"
NO_SHAPE_RULE = "no shape rule"


def mode() -> str:
    """'shapes' or 'compute' (every kernel runs), as SUPA_PLAN_MODE chose at activation."""
    return process_state.config().plan_mode


def notes() -> list[dict]:
    """[{kind (VALUE_DEPENDENT or NO_SHAPE_RULE), op, count, frames of the first call (innermost
    first)}]; empty in compute mode."""
    return list(process_state.core()._shapes_notes())
