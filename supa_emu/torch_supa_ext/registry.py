"""torch.library plumbing for the emulated torch_supa_ext: define ops, attach kernels, once only.

Every registration is idempotent and checked against the dispatcher rather than against a
module-level flag, because the package can be imported under two names (``torch_supa_ext`` via
the import hook and ``supa_emu.torch_supa_ext``) and each name gets its own module objects.
An op that already exists with a different schema is a conflict and fails the import.

Libraries are opened as FRAGMENTs: DeepSpeed itself adds ``deepspeed::`` ops through
``torch.library.custom_op`` and DeepCompile's extension owns ``dc::``, so a ``DEF`` library
could collide with either depending on import order.
"""

import torch

from .schemas import op_name

# torch.library.Library deregisters its ops when garbage-collected; keep them for the process.
_LIBRARIES = []


def _registered_schema(qualname: str):
    try:
        return str(torch._C._get_schema(qualname, ""))
    except RuntimeError:
        return None


def _has_kernel(qualname: str, dispatch_key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, dispatch_key)


class OpTable:
    """The ops of one schema table in one namespace, defined on construction."""

    def __init__(self, namespace: str, schemas):
        self.namespace = namespace
        self.names = tuple(op_name(s) for s in schemas)
        self._lib = torch.library.Library(namespace, "FRAGMENT")
        _LIBRARIES.append(self._lib)
        for schema in schemas:
            self._define(schema)

    def qualname(self, name: str) -> str:
        return f"{self.namespace}::{name}"

    def _define(self, schema: str) -> None:
        qualname = self.qualname(op_name(schema))
        existing = _registered_schema(qualname)
        if existing is None:
            self._lib.define(schema)
        elif existing != f"{self.namespace}::{schema}":
            raise ImportError(f"{qualname} is already registered with a different schema: "
                              f"{existing!r}, torch_supa_ext 2.12.0a1 defines {schema!r}")

    def impl(self, name: str, fn, dispatch_key: str) -> None:
        if not _has_kernel(self.qualname(name), dispatch_key):
            self._lib.impl(name, fn, dispatch_key)

    def fake(self, name: str, fn) -> None:
        # register_fake installs the Meta kernel; an op that already has one is done.
        if not _has_kernel(self.qualname(name), "Meta"):
            torch.library.register_fake(self.qualname(name), fn, lib=self._lib)
