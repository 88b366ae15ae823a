"""Registers the deepspeed:: and dc:: ops that torch_supa_ext 2.12.0a1 only stubs.

Each op gets its real schema, a fake (meta) implementation, and a CompositeExplicitAutograd
implementation raising ``NotImplementedError("<ns>::<name> not yet implemented on SUPA")``, the
real package's text, so code that probes or traces them behaves as on a SUPA machine.
"""

import torch

from .registry import OpTable
from .schemas import DC_NAMESPACE, DC_STUB_SCHEMAS, DEEPSPEED_NAMESPACE, STUB_SCHEMAS


def not_implemented_message(qualname: str) -> str:
    return f"{qualname} not yet implemented on SUPA"


def _raiser(qualname):
    def stub(*args, **kwargs):
        raise NotImplementedError(not_implemented_message(qualname))
    stub.__name__ = qualname.replace("::", "_")
    return stub


def _first_tensor(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
        if isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    return item
    return None


def _fake_value(type_str, like):
    # Shapes of the stubbed ops are not knowable without their kernels; a tensor shaped like the
    # first tensor argument keeps tracing going (most of these ops return a buffer of that shape).
    if type_str == "Tensor":
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    if type_str == "List[Tensor]":
        return [torch.empty_like(like, memory_format=torch.contiguous_format)]
    if type_str == "int":
        return 0
    if type_str == "bool":
        return True
    raise TypeError(f"no fake value for return type {type_str}")


def _schema_fake(qualname):
    returns = [str(r.type) for r in torch._C._get_schema(qualname, "").returns]

    def fake(*args, **kwargs):
        like = _first_tensor(list(args) + list(kwargs.values()))
        values = [_fake_value(r, like) for r in returns]
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)
    return fake


def _lamb_fake(p, *_):
    # DeepSpeed's lamb returns its one-element fp32 trust-ratio coefficient.
    return p.new_empty((1,), dtype=torch.float32)


_SPECIFIC_FAKES = {"deepspeed::lamb": _lamb_fake}


def _register(namespace, schemas):
    table = OpTable(namespace, schemas)
    for name in table.names:
        qualname = table.qualname(name)
        table.impl(name, _raiser(qualname), "CompositeExplicitAutograd")
        table.fake(name, _SPECIFIC_FAKES.get(qualname) or _schema_fake(qualname))
    return table


DEEPSPEED_STUB_OPS = _register(DEEPSPEED_NAMESPACE, STUB_SCHEMAS).names
DC_STUB_OPS = _register(DC_NAMESPACE, DC_STUB_SCHEMAS).names
