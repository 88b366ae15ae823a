"""A bccl process group in which only this rank exists: collectives follow the uniform-rank rule.

The planner's rank process plays rank r of an N-rank world. Every collective answers as if each
rank held this rank's data, so shapes, buffers and control flow are those of the real run:
all_reduce SUM gives local x N (PREMUL_SUM: local x factor x N) (PRODUCT local ** N), AVG/MIN/MAX/BAND/BOR keep the local value,
BXOR gives zero on an even group; gathers replicate the input; a reduce_scatter gives this
rank's chunk reduced N times; barrier returns at once. A broadcast gives a non-root the root's
value when it is small and the root was played first (see ROOT_VALUE_LIMIT), else the local one.

The group is a ProcessGroupBCCL without gloo: the identity, the operand checks and views
(operands.py, `_pair_operands`), the coalescing and the finishing step (`_finish`, which also
records the call) are bccl's own, so a planned call checks, allocates and records what a real one
does. bccl moves data through host views of device memory and allocates nothing on the card, and
neither does this group. Where the answer depends on values only other ranks hold (uneven
all_to_all splits, a scatter's or recv's data), the call is flagged for the report.
"""

import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from supa_emu.distributed import call_record, composed, operands
from supa_emu.distributed.c10d_backend import check_split, group_options
from supa_emu.distributed.arguments import check_reduction, require_device, single
from supa_emu.distributed.host_memory import HostCall, host_view
from supa_emu.distributed.process_group import ProcessGroupBCCL

_RedOp = dist.ReduceOp.RedOpType

# Set by the planner's rank process (rank_process.play): (rank, world size, pid).
_played: Optional[tuple] = None
_groups_created = 0

# What the first played rank broadcast as a root, for the ranks played after it: a program that
# broadcasts a placeholder from non-roots (DeepSpeed's "same list on every rank" checks) needs
# the root's value, which the uniform rule cannot give. Small tensors only: large broadcasts are
# parameter syncs, where the local value is the right answer.
ROOT_VALUE_LIMIT = 1 << 16
_values_file: Optional[str] = None
_root_values: Dict[tuple, torch.Tensor] = {}
_broadcasts: Dict[str, int] = {}


class PlanError(RuntimeError):
    """The script asks for something a planned world cannot give (one line, naming the problem)."""


def play(rank: int, world_size: int, values_file: Optional[str] = None) -> None:
    """Makes this process the one that plays `rank` of a `world_size`-rank world; `values_file`
    holds (or, if absent, receives) the small values the roots of broadcasts sent."""
    global _played, _values_file
    _played = (rank, world_size, os.getpid())
    _values_file = values_file
    if values_file is not None and os.path.exists(values_file):
        _root_values.update(torch.load(values_file))


def root_value(group_name: str, host: torch.Tensor, is_root: bool) -> Optional[torch.Tensor]:
    """What the root of a broadcast of `host` (this rank's tensor, in host memory) sent, for a
    non-root rank where it is known: a small value of the first rank played. None where this
    rank's own value stands: on the root (whose small values are kept for the ranks played
    later), for large tensors, and where the root's value is not known (flagged for the report)."""
    _broadcasts[group_name] = _broadcasts.get(group_name, 0) + 1
    key = (group_name, _broadcasts[group_name], host.dtype, host.numel())
    small = host.numel() * host.element_size() <= ROOT_VALUE_LIMIT
    if is_root:
        if small and _values_file is not None and not os.path.exists(_values_file):
            _root_values[key] = host.clone()
        return None
    if not small:
        return None  # a large value: every rank holds this rank's
    if key not in _root_values:
        call_record.flag("broadcast: the root's value is not known (its rank was not played first); "
                         "this rank's own value stands in")
    return _root_values.get(key)


def receive_own_chunk(chunks: List[torch.Tensor], mine: torch.Tensor, operation: str) -> None:
    """An all_to_all's received chunks under the rule: every rank sent this rank what it sends itself."""
    if any(chunk.numel() != mine.numel() for chunk in chunks):
        call_record.flag(f"{operation} with uneven splits: what each rank sends depends on its own data "
                         f"(e.g. MoE routing); chunks of another size keep their contents")
    for chunk in chunks:
        if chunk.numel() == mine.numel():
            chunk.copy_(mine.reshape(chunk.shape))


def save_root_values() -> None:
    """Keeps this rank's small broadcast values for the ranks played later (the first played rank only)."""
    if _values_file is not None and not os.path.exists(_values_file):
        torch.save(_root_values, _values_file)


def groups_created() -> int:
    return _groups_created


def admit(group_rank: int, group_size: int) -> None:
    """Checks that a group this process creates belongs to the planned world (raises PlanError)."""
    global _groups_created
    if _played is None or _played[2] != os.getpid():
        raise PlanError(
            "planner: the script spawns its own ranks (a process it started initialises a process group); "
            "the planner runs one process per rank as a launcher does: run the script without spawning")
    rank, world_size, _ = _played
    if _groups_created == 0 and (group_size, group_rank) != (world_size, rank):
        raise PlanError(
            f"planner: the script asks for rank {group_rank} of {group_size}, "
            f"but this process plays rank {rank} of {world_size}: take rank and world size from the "
            f"environment (RANK, WORLD_SIZE) as under a launcher")
    _groups_created += 1


def create(backend_options, pg_options=None) -> "ProcessGroupUniform":
    """The bccl backend's creator while planning (supa_emu.distributed routes here)."""
    admit(backend_options.group_rank, backend_options.group_size)
    return ProcessGroupUniform(backend_options.store, backend_options.group_rank, backend_options.group_size,
                               group_options(backend_options, pg_options))


def _reduce_uniform(view: torch.Tensor, kind, size: int) -> None:
    """`view` becomes the reduction of `size` copies of itself (in place, on host memory)."""
    if view.dtype == torch.bool or kind in (_RedOp.AVG, _RedOp.MIN, _RedOp.MAX, _RedOp.BAND, _RedOp.BOR):
        return  # bool SUM/PRODUCT are OR/AND; an average or extremum of equal values is the value
    if kind in (_RedOp.SUM, _RedOp.PREMUL_SUM):  # a PREMUL_SUM's view was premultiplied
        view.mul_(size)
    elif kind == _RedOp.PRODUCT:
        view.pow_(size)
    elif kind == _RedOp.BXOR:
        if size % 2 == 0:
            view.zero_()
    else:
        raise ValueError(f"bccl: reduction {kind} is not supported")


class ProcessGroupUniform(ProcessGroupBCCL):
    """bccl's process group with the peers replaced by the uniform-rank rule (see the module)."""

    def __init__(self, store: dist.Store, rank: int, size: int, options: ProcessGroupBCCL.Options):
        dist.ProcessGroup.__init__(self, rank, size)
        self.options = options
        self._store = store
        self._label = repr(options.group_name or "default")
        self._gloo = None
        self._agreement = None
        self._coalesced = None
        self._init_backend_state()

    def _close(self, how: str) -> None:
        self._closed = how  # no peers and no gloo to release; later use raises as on bccl

    def _agree_on_split(self, prefix, mine) -> None:
        # Every rank of a uniform world splits as this one does: its own post is all there is to check.
        if mine is not None:
            check_split([mine if r in mine else None for r in range(self.size())], self.size())

    def _done(self, call: HostCall, outputs=()):
        return self._finish([], call, outputs)

    # ---- reductions -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        tensor, kind, opts = operands.all_reduce(tensors, opts)
        call = HostCall()
        _reduce_uniform(composed.premultiplied(call.view(tensor), opts.reduceOp, in_place=True), kind, self.size())
        return self._done(call, [tensor])

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        require_device(tensors, "input")
        call = HostCall()
        for tensor in tensors:
            kind = check_reduction(opts.reduceOp, tensor.dtype)
            _reduce_uniform(composed.premultiplied(call.view(tensor), opts.reduceOp, in_place=True), kind, self.size())
        return self._done(call, tensors)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        tensor = single(tensors, "input")
        kind = check_reduction(opts.reduceOp, tensor.dtype)
        call = HostCall()
        if self.rank() == opts.rootRank:
            _reduce_uniform(composed.premultiplied(call.view(tensor), opts.reduceOp, in_place=True), kind, self.size())
        else:
            call.track(tensor, write=False)
        return self._done(call, [tensor])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        output, inputs = operands.reduce_scatter(outputs, input_lists, self.size(), self.rank())
        kind = check_reduction(opts.reduceOp, output.dtype)
        call = HostCall()
        out_view = call.view(output, read=False)
        in_views = [call.view(t, write=False) for t in inputs]
        out_view.copy_(in_views[self.rank()].reshape(out_view.shape))
        _reduce_uniform(composed.premultiplied(out_view, opts.reduceOp, in_place=True), kind, self.size())
        return self._done(call, [output])

    def _reduce_scatter_tensors(self, outputs, inputs, opts, operation):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        call = HostCall()
        views = self._pairs_operands(outputs, inputs, operation, call, False)
        for out_view, in_view in views:
            kind = check_reduction(opts.reduceOp, out_view.dtype)
            chunk = out_view.numel()
            out_view.copy_(in_view[self.rank() * chunk:(self.rank() + 1) * chunk])
            _reduce_uniform(composed.premultiplied(out_view, opts.reduceOp, in_place=True), kind, self.size())
        return self._done(call, outputs)

    # ---- data movement ------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        tensor, opts = operands.broadcast(tensors, opts)
        call = HostCall()
        is_root = self.rank() == opts.rootRank
        value = root_value(self.options.group_name, host_view(tensor), is_root)
        if value is None:
            call.track(tensor, read=is_root)  # this rank's own value stands
        else:
            call.view(tensor, read=False).copy_(value.reshape(tensor.shape))
        return self._done(call, [tensor])

    def allgather(self, output_lists, inputs, opts=None):
        input, outputs = operands.all_gather(output_lists, inputs, self.size(), self.rank())
        call = HostCall()
        source = call.view(input, write=False)
        for output in outputs:
            view = call.view(output, read=False)
            if view.numel() != source.numel():
                call_record.flag("all_gather with unequal sizes: the other ranks' slots keep their contents")
                continue
            view.copy_(source.reshape(view.shape))
        return self._done(call, outputs)

    def all_gather_single(self, output, input, opts=None):
        return self._all_gather_tensors([output], [input], opts, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def _all_gather_tensors(self, outputs, inputs, opts, operation):
        call = HostCall()
        for out_view, in_view in self._pairs_operands(outputs, inputs, operation, call, True):
            out_view.view(self.size(), -1).copy_(in_view.view(1, -1))
        return self._done(call, outputs)

    def gather(self, output_lists, inputs, opts=None):
        input, outputs, _, _ = operands.gather(output_lists, inputs, opts, self.size(), self.rank())
        call = HostCall()
        source = call.view(input, write=False)
        for output in outputs:
            call.view(output, read=False).copy_(source.reshape(output.shape))
        return self._done(call, outputs)

    def scatter(self, outputs, input_lists, opts=None):
        output, inputs, is_root, _ = operands.scatter(outputs, input_lists, opts, self.size(), self.rank())
        call = HostCall()
        out_view = call.view(output, read=False) if is_root else None
        if is_root:
            out_view.copy_(call.view(inputs[self.rank()], write=False).reshape(out_view.shape))
            for i, entry in enumerate(inputs):
                if i != self.rank():
                    call.track(entry, write=False)
        else:
            call.track(output, read=False)
            call_record.flag("scatter: a non-root rank's output is the root's data; it keeps its contents")
        return self._done(call, [output])

    def alltoall(self, outputs, inputs, opts=None):
        operands.all_to_all(outputs, inputs, self.size())
        call = HostCall()
        # Rank j sends me its inputs[me]; under the rule that is this rank's inputs[me].
        mine = call.view(inputs[self.rank()], write=False)
        for i, input in enumerate(inputs):
            if i != self.rank():
                call.track(input, write=False)
        receive_own_chunk([call.view(t, read=False) for t in outputs], mine, "all_to_all")
        return self._done(call, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        send, receive = operands.all_to_all_single(output, input, output_split_sizes, input_split_sizes, self.size())
        call = HostCall()
        in_flat = call.view(input, write=False).reshape(-1)
        out_view = call.view(output, read=False)
        start = sum(send[:self.rank()])
        mine = in_flat[start:start + send[self.rank()]]
        receive_own_chunk(list(out_view.view(-1).split(receive)), mine, "all_to_all_single")
        return self._done(call, [output])

    alltoall_base = all_to_all_single

    # ---- synchronisation and point-to-point -------------------------------------------------
    def barrier(self, opts=None):
        return self._done(HostCall())

    def send(self, tensors, dst_rank, tag=0):
        call = HostCall()
        call.track(single(tensors, "tensor"), write=False)
        return self._done(call)

    def recv(self, tensors, src_rank, tag=0):
        tensor = single(tensors, "tensor")
        call = HostCall()
        call.track(tensor, read=False)
        call_record.flag("recv: the data another rank sends is not known; the buffer keeps its contents")
        return self._done(call, [tensor])

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, -1, tag)


__all__ = ["PlanError", "ProcessGroupUniform", "admit", "create", "groups_created", "play", "receive_own_chunk", "root_value",
           "save_root_values"]
