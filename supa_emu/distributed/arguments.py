"""Argument checks of bccl collectives: device, layout, list lengths, element counts and dtypes.

Each check raises before any rank talks to a peer, with a message that names the collective, the
offending argument and what is accepted (TypeError for wrong types and dtypes, ValueError for
wrong devices, layouts and sizes, as the device backends raise them).
"""

from typing import List, Sequence

import torch
import torch.distributed

from . import host_memory


def numel(tensors: Sequence[torch.Tensor]) -> List[int]:
    return [t.numel() for t in tensors]


def require_device(tensors: Sequence[torch.Tensor], role: str) -> None:
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"bccl: {role} must be tensors, got {type(tensor).__name__}")
        if not host_memory.is_device_tensor(tensor) or tensor.layout != torch.strided:
            raise ValueError(
                f"bccl: tensors must be {host_memory.DEVICE_TYPE} and dense; the {role} is a "
                f"{tensor.layout} tensor on device '{tensor.device}'"
            )


def single(tensors: Sequence[torch.Tensor], role: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"bccl: expects exactly one {role} tensor per call, got {len(tensors)}")
    require_device(tensors, role)
    return tensors[0]


def reduce_kind(op) -> torch.distributed.ReduceOp.RedOpType:
    """The reduction of a ReduceOp or of its RedOpType."""
    if isinstance(op, torch.distributed.ReduceOp.RedOpType):
        return op
    return op.op


# The dtype NCCL reads a PREMUL_SUM factor as, for each input dtype it premultiplies (a bfloat16
# input takes a float factor); other input dtypes are refused.
PREMUL_FACTOR_DTYPES = {
    torch.float16: torch.float16,
    torch.float32: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float64: torch.float64,
}


def check_reduce_op(kind, dtype: torch.dtype) -> None:
    # Checked before the agreement step: a collective that may start early must not fail after it.
    if kind == torch.distributed.ReduceOp.RedOpType.PREMUL_SUM and dtype not in PREMUL_FACTOR_DTYPES:
        raise TypeError(f"bccl: PreMulSum Data type must be half, float, bfloat16 or double, got {dtype}")
    if kind == torch.distributed.ReduceOp.RedOpType.AVG and dtype == torch.bool:
        raise ValueError("bccl: ReduceOp.AVG is not defined for torch.bool")


def check_reduction(op, dtype: torch.dtype) -> torch.distributed.ReduceOp.RedOpType:
    """The kind of reduction `op` (a ReduceOp or RedOpType) names, checked for inputs of `dtype`;
    a PREMUL_SUM's factor is checked too (premul_factor)."""
    kind = reduce_kind(op)
    check_reduce_op(kind, dtype)
    if kind == torch.distributed.ReduceOp.RedOpType.PREMUL_SUM:
        premul_factor(op, dtype)
    return kind


def premul_factor(op, dtype: torch.dtype):
    """The factor of PREMUL_SUM reduction `op` for inputs of `dtype`: a Python number, or a
    one-element device tensor of the dtype NCCL reads it as (PREMUL_FACTOR_DTYPES)."""
    factor = getattr(op, "factor", None)
    if factor is None:
        raise ValueError("bccl: ReduceOp.PREMUL_SUM needs a factor: pass ReduceOp.PREMUL_SUM(factor) "
                         "(a number or a one-element device tensor)")
    if isinstance(factor, torch.Tensor):
        if not host_memory.is_device_tensor(factor):
            raise ValueError(f"bccl: a PREMUL_SUM tensor factor must live on {host_memory.DEVICE_TYPE} "
                             f"(the card reads it), got a tensor on '{factor.device}'")
        expected = PREMUL_FACTOR_DTYPES[dtype]
        if factor.dtype != expected:
            # What NCCL's unpacking of the factor raises (a typed read of the factor's data).
            raise RuntimeError(f"expected scalar type {_scalar_type_name(expected)} but found "
                               f"{_scalar_type_name(factor.dtype)}")
    return factor


def _scalar_type_name(dtype: torch.dtype) -> str:
    return {torch.float16: "Half", torch.float32: "Float", torch.bfloat16: "BFloat16",
            torch.float64: "Double"}.get(dtype, str(dtype).removeprefix("torch."))


def check_dtypes(a: torch.Tensor, b: torch.Tensor, operation: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"bccl: {operation} tensors must share a dtype, got {a.dtype} and {b.dtype}")


def check_sizes(actual: int, expected: int, group_size: int, operation: str, input, output) -> None:
    if actual != expected:
        raise ValueError(
            f"bccl: {operation} needs output numel == input numel x group size ({group_size}) "
            f"(or the reverse for reductions); got input {tuple(input.shape)} and output {tuple(output.shape)}"
        )


def check_chunk(mine: torch.Tensor, entry: torch.Tensor, operation: str, mine_role: str, entry_role: str) -> None:
    if mine.numel() != entry.numel():
        raise ValueError(
            f"bccl: {operation} {mine_role} {tuple(mine.shape)} does not match this rank's "
            f"{entry_role} {tuple(entry.shape)}"
        )
    check_dtypes(mine, entry, operation)


def pairs(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], operation: str):
    """The (output, input) pairs of a tensor-list collective, which takes as many of each."""
    if len(outputs) != len(inputs):
        raise ValueError(f"bccl: {operation} needs as many output as input tensors, got {len(outputs)} and {len(inputs)}")
    return zip(outputs, inputs)


def per_rank_list(lists, group_size: int, operation: str, role: str) -> List[torch.Tensor]:
    """The one list of `group_size` device tensors that all_gather / reduce_scatter / gather / scatter take."""
    if len(lists) != 1 or len(lists[0]) != group_size:
        raise ValueError(f"bccl: {operation} needs one {role} list of {group_size} tensors")
    require_device(lists[0], role)
    return lists[0]


def root_list(lists, is_root: bool, mine: torch.Tensor, group_size: int, operation: str,
              role: str) -> List[torch.Tensor]:
    """The root's per-rank tensors of gather/scatter, each checked against this rank's tensor."""
    if not is_root:
        return []
    if len(lists) != 1 or len(lists[0]) != group_size:
        raise ValueError(f"bccl: {operation} needs one {role} list of {group_size} tensors on the root")
    entries = lists[0]
    require_device(entries, role)
    for entry in entries:
        check_chunk(mine, entry, operation, "tensor", f"{role} list entry")
    return entries


def split_counts(tensor: torch.Tensor, split_sizes, group_size: int, role: str) -> List[int]:
    """Elements all_to_all_single exchanges with each rank, from split sizes along dim 0 (equal split if none)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row = tensor.numel() // rows if rows else 0
    if not split_sizes:
        if rows % group_size:
            raise ValueError(
                f"bccl: all_to_all_single {role} dim 0 ({rows}) is not divisible by the group size ({group_size})"
            )
        return [rows // group_size * row] * group_size
    if len(split_sizes) != group_size or sum(split_sizes) != rows:
        raise ValueError(
            f"bccl: all_to_all_single {role} split sizes {list(split_sizes)} do not cover dim 0 "
            f"({rows}) in {group_size} parts"
        )
    return [s * row for s in split_sizes]
