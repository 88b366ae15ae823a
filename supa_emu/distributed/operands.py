"""The checked operands of each bccl collective: where a real call (process_group.py) and a
planned one (supa_emu/plan/uniform_group.py) both start.

Each function takes a c10d entry point's arguments as torch passes them, applies the checks of
arguments.py in the order the device backends do, and returns the operands the call works on,
so that both groups accept, refuse and size a call alike.
"""

from typing import List, Tuple

import torch
import torch.distributed as dist

from .arguments import (
    check_chunk, check_dtypes, check_reduction, per_rank_list, require_device, root_list, single, split_counts)


def all_reduce(tensors, opts) -> Tuple[torch.Tensor, object, dist.AllreduceOptions]:
    """(tensor, reduction, options); `opts` may be AllreduceOptions or a bare ReduceOp (or None)."""
    if not isinstance(opts, dist.AllreduceOptions):
        op, opts = opts, dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op is None else op
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensor = single(tensors, "input")
    return tensor, check_reduction(opts.reduceOp, tensor.dtype), opts


def reduce_scatter(outputs, input_lists, group_size: int, rank: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """(output, the per-rank inputs) of the list form of reduce_scatter."""
    output = single(outputs, "output")
    inputs = per_rank_list(input_lists, group_size, "reduce_scatter", "input")
    check_chunk(output, inputs[rank], "reduce_scatter", "output", "input list entry")
    return output, inputs


def broadcast(tensors, opts) -> Tuple[torch.Tensor, dist.BroadcastOptions]:
    """(tensor, options); `opts` may be BroadcastOptions or a bare root rank (or None)."""
    if not isinstance(opts, dist.BroadcastOptions):
        root, opts = opts, dist.BroadcastOptions()
        opts.rootRank = 0 if root is None else root
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return single(tensors, "tensor"), opts


def all_gather(output_lists, inputs, group_size: int, rank: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """(input, the per-rank outputs) of the list form of all_gather."""
    input = single(inputs, "input")
    outputs = per_rank_list(output_lists, group_size, "all_gather", "output")
    check_chunk(input, outputs[rank], "all_gather", "input", "output list entry")
    for output in outputs:
        check_dtypes(output, input, "all_gather")
    return input, outputs


def gather(output_lists, inputs, opts, group_size: int, rank: int):
    """(input, the root's outputs (empty elsewhere), is_root, options)."""
    opts = opts if opts is not None else dist.GatherOptions()
    input = single(inputs, "input")
    is_root = rank == opts.rootRank
    return input, root_list(output_lists, is_root, input, group_size, "gather", "output"), is_root, opts


def scatter(outputs, input_lists, opts, group_size: int, rank: int):
    """(output, the root's inputs (empty elsewhere), is_root, options)."""
    opts = opts if opts is not None else dist.ScatterOptions()
    output = single(outputs, "output")
    is_root = rank == opts.rootRank
    return output, root_list(input_lists, is_root, output, group_size, "scatter", "input"), is_root, opts


def all_to_all(outputs, inputs, group_size: int) -> None:
    """Checks the list form of all_to_all: one input and one output per rank, pairwise of one dtype."""
    if len(outputs) != group_size or len(inputs) != group_size:
        raise ValueError(f"bccl: all_to_all needs {group_size} input and output tensors")
    require_device(outputs, "output")
    require_device(inputs, "input")
    for output, input in zip(outputs, inputs):
        check_dtypes(output, input, "all_to_all")


def all_to_all_single(output, input, output_split_sizes, input_split_sizes, group_size: int):
    """(elements sent to, elements received from) each rank by all_to_all_single."""
    require_device([output], "output")
    require_device([input], "input")
    check_dtypes(output, input, "all_to_all_single")
    send = split_counts(input, input_split_sizes, group_size, "input")
    receive = split_counts(output, output_split_sizes, group_size, "output")
    return send, receive
