"""What an operator does to its tensor arguments, as the stream sanitizer needs it: read from the
op's schema (`Tensor(a!)` is written, `Tensor(a)` only aliased, results without an alias
annotation are fresh allocations), plus the few operators whose schema does not tell the whole
story (metadata-only ones, copies, ones that make the host wait)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

# Operators that look at a tensor's metadata only, though their schema does not say so.
METADATA_ONLY = frozenset({
    "aten::is_pinned", "aten::size", "aten::stride", "aten::sym_size",
    "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset", "aten::is_same_size",
    "aten::is_set_to", "aten::result_type", "aten::_has_compatible_shallow_copy_type",
    "aten::record_stream", "aten::set_", "aten::_nested_tensor_size", "aten::dim", "aten::numel",
})
COPIES = frozenset({"aten::copy_", "aten::_to_copy"})
# Operators after which the host has waited for the stream (a value comes back to Python).
HOST_SYNCHRONISING = frozenset({
    "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero",
    "aten::masked_select", "aten::unique_consecutive", "aten::_unique2",
})


class OpSpec:
    """What the sanitizer needs of an operator's schema, computed once per overload."""

    __slots__ = ("name", "arguments", "fresh_returns", "metadata_only", "synchronising")

    def __init__(self, func) -> None:
        schema = func._schema
        self.name = schema.name
        self.metadata_only = schema.name in METADATA_ONLY
        self.synchronising = schema.name in HOST_SYNCHRONISING
        self.arguments: List[Tuple[int, str, bool]] = []
        for index, arg in enumerate(schema.arguments):
            if not holds_tensors(arg.type):
                continue
            alias = arg.alias_info
            if alias is not None and not alias.is_write:
                continue  # a view or alias of the argument is made; its data is not touched
            self.arguments.append((index if not arg.kwarg_only else -1, arg.name, alias is not None))
        self.fresh_returns = tuple(i for i, ret in enumerate(schema.returns)
                                   if ret.alias_info is None and holds_tensors(ret.type))


def holds_tensors(arg_type) -> bool:
    text = str(arg_type)
    return text.startswith("Tensor") or text.startswith("Optional[Tensor]") or text.startswith("List[Tensor]") \
        or text.startswith("List[Optional[Tensor]]")


def split_tensors(value, out: list, host: Optional[list] = None) -> None:
    """Appends the supa tensors in `value` (a tensor or a list) to `out`, its CPU ones to `host`."""
    for item in (value,) if isinstance(value, torch.Tensor) else value if isinstance(value, (list, tuple)) else ():
        if not isinstance(item, torch.Tensor):
            continue
        if not item.is_cpu:
            if item.get_device() >= 0:
                out.append(item)
        elif host is not None:
            host.append(item)
