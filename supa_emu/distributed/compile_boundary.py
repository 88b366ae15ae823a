"""Keeps torch.compile out of bccl's own Python code.

On a GPU the process group and its works are C++ objects, so a compiled region that reaches a
collective (DDP's reducer broadcasting rebuilt buckets from inside a compiled forward, a comm hook
waiting on a work) never meets a Python frame of the backend. bccl's group and works are Python
subclasses of them, and c10d calls their methods through pybind11; dynamo would try to compile
those frames, and the group is an opaque object to it whose attributes it refuses to read. Their
code objects are marked to run eagerly, callees included, as dynamo's own `disable` marks code;
the mark lives in torch's C extension, so nothing of dynamo is imported for it.
"""

import types

from torch._C._dynamo import eval_frame


def run_eagerly(*classes: type) -> None:
    """Mark every method and property of `classes` and of their bases from this package to run
    uncompiled (torch's own bases are C++ or torch's code, which dynamo handles itself)."""
    eager = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
    ours = {base for cls in classes for base in cls.__mro__ if base.__module__.startswith("supa_emu.")}
    for cls in ours:
        for attribute in vars(cls).values():
            if isinstance(attribute, (staticmethod, classmethod)):
                attribute = attribute.__func__
            functions = [attribute.fget, attribute.fset] if isinstance(attribute, property) else [attribute]
            for function in functions:
                if isinstance(function, types.FunctionType):
                    eval_frame.set_code_exec_strategy(function.__code__, eager)
