"""One collective call as ProcessGroupBCCL hands it to its transport: the record, the op names, the checks.

Each c10d entry point of the group turns its arguments into one `Collective` with the function
of this module named after the op, which checks them first, in the order the device backends
do: TypeError for wrong types and dtypes, ValueError for wrong devices, layouts and sizes, each
naming the collective, the offending argument and what is accepted. The checks are those of the
group's kind (`group_kind`, a process_group.GroupKind): its tensors live on its `device_type`,
and its `name` starts each error ("bccl: ..."; "gloo: ..." in a planned rank's gloo groups).
Nothing has reached a peer when a check raises. The record then names the call for everyone who
reports it (the planner's recorder, the profiler, the stream and memory checkers) and for the
signature that ranks agree on, so no one needs to know which method issued it.
"""

from typing import List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from supa_emu import process_state

_RedOp = dist.ReduceOp.RedOpType


class Operation(NamedTuple):
    method: str  # the ProcessGroup method c10d calls: what the checkers' reports name
    profiled_as: str  # the name of its profiler range, as c10d's NCCL backend names it


# Every op a bccl group issues, by the name torch.distributed gives it (the recorder's and the
# agreement's name; its position is the agreement's op code).
OPERATIONS = {
    "all_reduce": Operation("allreduce", "all_reduce"),
    "all_reduce_coalesced": Operation("allreduce_coalesced", "all_reduce_coalesced"),
    "broadcast": Operation("broadcast", "broadcast"),
    "reduce": Operation("reduce", "reduce"),
    "all_gather": Operation("allgather", "all_gather"),
    "all_gather_into_tensor": Operation("all_gather_single", "_allgather_base"),
    "all_gather_into_tensor_coalesced": Operation("all_gather_single_coalesced", "_allgather_base"),
    "gather": Operation("gather", "gather"),
    "scatter": Operation("scatter", "scatter"),
    "reduce_scatter": Operation("reduce_scatter", "reduce_scatter"),
    "reduce_scatter_tensor": Operation("reduce_scatter_single", "_reduce_scatter_base"),
    "reduce_scatter_tensor_coalesced": Operation("reduce_scatter_single_coalesced", "_reduce_scatter_base"),
    "all_to_all": Operation("alltoall", "all_to_all"),
    "all_to_all_single": Operation("all_to_all_single", "all_to_all"),
    "barrier": Operation("barrier", "barrier"),
    "send": Operation("send", "send"),
    "recv": Operation("recv", "recv"),
}
POINT_TO_POINT = frozenset({"send", "recv"})  # not agreed on, not numbered: peers are not in lockstep


class Collective:
    """One call: `op` (a key of OPERATIONS), the group's tensors it reads (`inputs`) and writes
    (`outputs`; a tensor in both is updated in place), and what the op needs besides:

    - `reduce_op`: the ReduceOp as given (a PREMUL_SUM carries its factor, which the transport
      applies: host_memory.contribution), `kind` its checked RedOpType;
    - `root`: the root rank of broadcast, reduce, gather and scatter (-1 for the others);
    - `options`: c10d's options object of the call (its timeout; the transport passes it on);
    - `results`: what the work's result() returns (the outputs unless said otherwise);
    - `peer`, `tag`: of send and recv (peer None: a receive from any source);
    - `counts`: elements sent to and received from each rank by an all-to-all, `splits`: the
      split sizes all_to_all_single was given (output's, input's).

    Pairs (`all_gather_into_tensor`, `reduce_scatter_tensor` and their coalesced forms) list their
    outputs and inputs in matching order.
    """

    __slots__ = ("op", "inputs", "outputs", "reduce_op", "kind", "root", "options", "results", "peer", "tag",
                 "counts", "splits")

    def __init__(self, op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], options=None,
                 reduce_op=None, kind: Optional[_RedOp] = None, root: int = -1, results=None,
                 peer: Optional[int] = -1, tag: int = 0, counts=None, splits=None):
        self.op, self.inputs, self.outputs, self.options = op, inputs, outputs, options
        self.reduce_op, self.kind = reduce_op, kind
        self.root, self.peer, self.tag, self.counts, self.splits = root, peer, tag, counts, splits
        self.results = outputs if results is None else results

    @property
    def operation(self) -> Operation:
        return OPERATIONS[self.op]

    def accesses(self) -> List[tuple]:
        """(tensor, read, write) of every tensor of the call, outputs first."""
        inputs, outputs = self.inputs, self.outputs
        written = [(t, any(t is i for i in inputs), True) for t in outputs]
        return written + [(t, True, False) for t in inputs if not any(t is o for o in outputs)]


# ---- the records of the c10d entry points ------------------------------------------------------
def all_reduce(group_kind, tensors, opts) -> Collective:
    """`opts` may be AllreduceOptions or a bare ReduceOp (or None)."""
    if not isinstance(opts, dist.AllreduceOptions):
        op, opts = opts, dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op is None else op
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensor = single(group_kind, tensors, "input")
    kind = check_reduction(group_kind, opts.reduceOp, tensor.dtype)
    return Collective("all_reduce", [tensor], [tensor], opts, opts.reduceOp, kind)


def all_reduce_coalesced(group_kind, tensors, opts) -> Collective:
    opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
    require_device(group_kind, tensors, "input")
    for tensor in tensors:
        check_reduction(group_kind, opts.reduceOp, tensor.dtype)
    return Collective("all_reduce_coalesced", tensors, tensors, opts, opts.reduceOp, reduce_kind(opts.reduceOp))


def reduce(group_kind, tensors, opts, rank: int) -> Collective:
    opts = opts if opts is not None else dist.ReduceOptions()
    tensor = single(group_kind, tensors, "input")
    kind = check_reduction(group_kind, opts.reduceOp, tensor.dtype)
    # Only the root's tensor receives the result; elsewhere it is read and left intact.
    written = [tensor] if rank == opts.rootRank else []
    return Collective("reduce", [tensor], written, opts, opts.reduceOp, kind, opts.rootRank, results=[tensor])


def broadcast(group_kind, tensors, opts, rank: int) -> Collective:
    """`opts` may be BroadcastOptions or a bare root rank (or None)."""
    if not isinstance(opts, dist.BroadcastOptions):
        root, opts = opts, dist.BroadcastOptions()
        opts.rootRank = 0 if root is None else root
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensor = single(group_kind, tensors, "tensor")
    return Collective("broadcast", [tensor] if rank == opts.rootRank else [], [tensor], opts, root=opts.rootRank)


def all_gather(group_kind, output_lists, inputs, opts, size: int, rank: int) -> Collective:
    """The list form: one input, one output per rank."""
    opts = opts if opts is not None else AllgatherOptions()
    input = single(group_kind, inputs, "input")
    outputs = per_rank_list(group_kind, output_lists, size, "all_gather", "output")
    check_chunk(group_kind, input, outputs[rank], "all_gather", "input", "output list entry")
    for output in outputs:
        check_dtypes(group_kind, output, input, "all_gather")
    return Collective("all_gather", [input], outputs, opts)


def all_gather_into_tensor(group_kind, outputs, inputs, opts, size: int,
                           op: str = "all_gather_into_tensor") -> Collective:
    """Pairs of an output and an input `size` times smaller (the coalesced form: several)."""
    opts = opts if opts is not None else AllgatherOptions()
    for output, input in pairs(group_kind, outputs, inputs, op):
        check_pair(group_kind, output, input, size, op, gather=True)
    return Collective(op, inputs, outputs, opts)


def gather(group_kind, output_lists, inputs, opts, size: int, rank: int) -> Collective:
    opts = opts if opts is not None else dist.GatherOptions()
    input = single(group_kind, inputs, "input")
    outputs = root_list(group_kind, output_lists, rank == opts.rootRank, input, size, "gather", "output")
    return Collective("gather", [input], outputs, opts, root=opts.rootRank)


def scatter(group_kind, outputs, input_lists, opts, size: int, rank: int) -> Collective:
    opts = opts if opts is not None else dist.ScatterOptions()
    output = single(group_kind, outputs, "output")
    inputs = root_list(group_kind, input_lists, rank == opts.rootRank, output, size, "scatter", "input")
    return Collective("scatter", inputs, [output], opts, root=opts.rootRank)


def reduce_scatter(group_kind, outputs, input_lists, opts, size: int, rank: int) -> Collective:
    """The list form: one output, one input per rank."""
    opts = opts if opts is not None else dist.ReduceScatterOptions()
    output = single(group_kind, outputs, "output")
    inputs = per_rank_list(group_kind, input_lists, size, "reduce_scatter", "input")
    check_chunk(group_kind, output, inputs[rank], "reduce_scatter", "output", "input list entry")
    kind = check_reduction(group_kind, opts.reduceOp, output.dtype)
    return Collective("reduce_scatter", inputs, [output], opts, opts.reduceOp, kind)


def reduce_scatter_tensor(group_kind, outputs, inputs, opts, size: int,
                          op: str = "reduce_scatter_tensor") -> Collective:
    """Pairs of an output and an input `size` times larger (the coalesced form: several)."""
    opts = opts if opts is not None else dist.ReduceScatterOptions()
    for output, input in pairs(group_kind, outputs, inputs, op):
        check_pair(group_kind, output, input, size, op, gather=False)
    kind = check_reduction(group_kind, opts.reduceOp, outputs[0].dtype) if outputs else reduce_kind(opts.reduceOp)
    return Collective(op, inputs, outputs, opts, opts.reduceOp, kind)


def all_to_all(group_kind, outputs, inputs, opts, size: int) -> Collective:
    """The list form: one input and one output per rank, pairwise of one dtype."""
    opts = opts if opts is not None else dist.AllToAllOptions()
    if len(outputs) != size or len(inputs) != size:
        raise ValueError(f"{group_kind.name}: all_to_all needs {size} input and output tensors")
    require_device(group_kind, outputs, "output")
    require_device(group_kind, inputs, "input")
    for output, input in zip(outputs, inputs):
        check_dtypes(group_kind, output, input, "all_to_all")
    return Collective("all_to_all", inputs, outputs, opts, counts=(numel(inputs), numel(outputs)))


def all_to_all_single(group_kind, output, input, output_split_sizes, input_split_sizes, opts, size: int) -> Collective:
    opts = opts if opts is not None else dist.AllToAllOptions()
    require_device(group_kind, [output], "output")
    require_device(group_kind, [input], "input")
    check_dtypes(group_kind, output, input, "all_to_all_single")
    send = split_counts(group_kind, input, input_split_sizes, size, "input")
    receive = split_counts(group_kind, output, output_split_sizes, size, "output")
    return Collective("all_to_all_single", [input], [output], opts, counts=(send, receive),
                      splits=(list(output_split_sizes), list(input_split_sizes)))


def barrier(group_kind, opts) -> Collective:
    return Collective("barrier", [], [], opts if opts is not None else dist.BarrierOptions())


def send(group_kind, tensors, peer: int, tag: int) -> Collective:
    return Collective("send", [single(group_kind, tensors, "tensor")], [], peer=peer, tag=tag)


def recv(group_kind, tensors, peer: Optional[int], tag: int) -> Collective:
    """`peer` None: from any source."""
    return Collective("recv", [], [single(group_kind, tensors, "tensor")], peer=peer, tag=tag)


# ---- the checks ------------------------------------------------------------------------------
def numel(tensors: Sequence[torch.Tensor]) -> List[int]:
    return [t.numel() for t in tensors]


def require_device(group_kind, tensors: Sequence[torch.Tensor], role: str) -> None:
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{group_kind.name}: {role} must be tensors, got {type(tensor).__name__}")
        if tensor.device.type != group_kind.device_type or tensor.layout != torch.strided:
            raise ValueError(
                f"{group_kind.name}: tensors must be {group_kind.device_type} and dense; the {role} is a "
                f"{tensor.layout} tensor on device '{tensor.device}'"
            )


def single(group_kind, tensors: Sequence[torch.Tensor], role: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{group_kind.name}: expects exactly one {role} tensor per call, got {len(tensors)}")
    require_device(group_kind, tensors, role)
    return tensors[0]


def reduce_kind(op) -> _RedOp:
    """The reduction of a ReduceOp or of its RedOpType."""
    if isinstance(op, _RedOp):
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


def check_reduction(group_kind, op, dtype: torch.dtype) -> _RedOp:
    """The kind of reduction `op` (a ReduceOp or RedOpType) names, checked for inputs of `dtype`;
    a PREMUL_SUM's factor is checked too (premul_factor)."""
    kind = reduce_kind(op)
    if kind == _RedOp.PREMUL_SUM:
        if dtype not in PREMUL_FACTOR_DTYPES:
            raise TypeError(
                f"{group_kind.name}: PreMulSum Data type must be half, float, bfloat16 or double, got {dtype}")
        premul_factor(group_kind, op, dtype)
    elif kind == _RedOp.AVG and dtype == torch.bool:
        raise ValueError(f"{group_kind.name}: ReduceOp.AVG is not defined for torch.bool")
    return kind


def premul_factor(group_kind, op, dtype: torch.dtype):
    """The factor of PREMUL_SUM reduction `op` for inputs of `dtype`: a Python number, or a
    one-element device tensor of the dtype NCCL reads it as (PREMUL_FACTOR_DTYPES)."""
    factor = getattr(op, "factor", None)
    if factor is None:
        raise ValueError(f"{group_kind.name}: ReduceOp.PREMUL_SUM needs a factor: pass ReduceOp.PREMUL_SUM(factor) "
                         "(a number or a one-element device tensor)")
    if isinstance(factor, torch.Tensor):
        if factor.device.type != group_kind.device_type:
            raise ValueError(f"{group_kind.name}: a PREMUL_SUM tensor factor must live on {group_kind.device_type} "
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


def check_dtypes(group_kind, a: torch.Tensor, b: torch.Tensor, operation: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{group_kind.name}: {operation} tensors must share a dtype, got {a.dtype} and {b.dtype}")


def check_pair(group_kind, output: torch.Tensor, input: torch.Tensor, size: int, op: str, gather: bool) -> None:
    """One output/input pair of an all_gather (gather=True) or a reduce_scatter: device tensors of
    one dtype, the output (of a gather; else the input) holding `size` times the other's elements."""
    if isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor) and process_state.core()._plain_pair(
            output, input, size, gather):
        return  # the common case (contiguous), in one native call
    require_device(group_kind, [output], "output")
    require_device(group_kind, [input], "input")
    larger, smaller = (output, input) if gather else (input, output)
    if larger.numel() != smaller.numel() * size:
        raise ValueError(
            f"{group_kind.name}: {op} needs output numel == input numel x group size ({size}) "
            f"(or the reverse for reductions); got input {tuple(input.shape)} and output {tuple(output.shape)}"
        )
    check_dtypes(group_kind, output, input, op)


def check_chunk(group_kind, mine: torch.Tensor, entry: torch.Tensor, operation: str, mine_role: str,
                entry_role: str) -> None:
    if mine.numel() != entry.numel():
        raise ValueError(
            f"{group_kind.name}: {operation} {mine_role} {tuple(mine.shape)} does not match this rank's "
            f"{entry_role} {tuple(entry.shape)}"
        )
    check_dtypes(group_kind, mine, entry, operation)


def pairs(group_kind, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], operation: str):
    """The (output, input) pairs of a tensor-list collective, which takes as many of each."""
    if len(outputs) != len(inputs):
        raise ValueError(
            f"{group_kind.name}: {operation} needs as many output as input tensors, got {len(outputs)} and {len(inputs)}")
    return zip(outputs, inputs)


def per_rank_list(group_kind, lists, size: int, operation: str, role: str) -> List[torch.Tensor]:
    """The one list of `size` device tensors that all_gather / reduce_scatter take."""
    if len(lists) != 1 or len(lists[0]) != size:
        raise ValueError(f"{group_kind.name}: {operation} needs one {role} list of {size} tensors")
    require_device(group_kind, lists[0], role)
    return lists[0]


def root_list(group_kind, lists, is_root: bool, mine: torch.Tensor, size: int, operation: str,
              role: str) -> List[torch.Tensor]:
    """The root's per-rank tensors of gather/scatter, each checked against this rank's tensor
    (none elsewhere)."""
    if not is_root:
        return []
    if len(lists) != 1 or len(lists[0]) != size:
        raise ValueError(f"{group_kind.name}: {operation} needs one {role} list of {size} tensors on the root")
    entries = lists[0]
    require_device(group_kind, entries, role)
    for entry in entries:
        check_chunk(group_kind, mine, entry, operation, "tensor", f"{role} list entry")
    return entries


def split_counts(group_kind, tensor: torch.Tensor, split_sizes, size: int, role: str) -> List[int]:
    """Elements all_to_all_single exchanges with each rank, from split sizes along dim 0 (equal split if none)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row = tensor.numel() // rows if rows else 0
    if not split_sizes:
        if rows % size:
            raise ValueError(
                f"{group_kind.name}: all_to_all_single {role} dim 0 ({rows}) is not divisible by the group size ({size})"
            )
        return [rows // size * row] * size
    if len(split_sizes) != size or sum(split_sizes) != rows:
        raise ValueError(
            f"{group_kind.name}: all_to_all_single {role} split sizes {list(split_sizes)} do not cover dim 0 "
            f"({rows}) in {size} parts"
        )
    return [s * row for s in split_sizes]
