"""The transport of a planned rank's groups: only this rank exists; collectives follow the uniform-rank rule.

The planner's rank process plays rank r of an N-rank world (world.py). Every collective answers
as if each rank held this rank's data, so shapes, buffers and control flow are those of the real
run: all_reduce SUM gives local x N (PREMUL_SUM: local x factor x N) (PRODUCT local ** N),
AVG/MIN/MAX/BAND/BOR keep the local value, BXOR gives zero on an even group; gathers replicate
the input; a reduce_scatter gives this rank's chunk reduced N times; barrier returns at once. A
broadcast gives a non-root the root's value when it is small and the root was played first
(world.root_value), else the local one.

The group is bccl's own ProcessGroupBCCL with this transport: every bccl group of a planned rank
(`install`), and its gloo groups too, as ("cpu", "gloo", this transport) (gloo_groups.py), so a
planned call is checked, counted and recorded by the code that checks, counts and records a real
one, and the rule is written once, here. Like the gloo transport, this one moves data through
host views of the group's tensors and allocates nothing on the card. Where the answer depends on
values only other ranks hold (uneven all_to_all splits, a scatter's or recv's data), the call is
flagged for the report; an all_to_all that permutes (each rank sends to one other, as ring
attention's does) is uniform under a shift by rank (uniform_sources).

In shapes mode a call whose payload on the card is larger than what the card moves there
(csrc/aten/shape_only.h, card_bytes_move: 64 KiB) moves no data; its outputs keep their contents
(host tensors, which shapes mode computes, always move theirs). That is exact for memory,
since the call allocates nothing on the card whatever it moves, and for control flow: values that
large were never computed in shapes mode (operators with more than 64 KiB of operands take their
results from shape rules, which read no values), while the small calls a program branches on
(overflow flags, norms, sizes exchanged, step counters) still move theirs.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from supa_emu import distributed, process_state
from supa_emu.device_type import DEVICE_TYPE
from supa_emu.distributed.collective import Collective
from supa_emu.distributed.host_memory import HostCall, contribution, host_view
from supa_emu.distributed.transport import Transport
from supa_emu.distributed.work import BCCLWork
from supa_emu.plan import call_record, p2p_messages, world

_RedOp = dist.ReduceOp.RedOpType


def install() -> None:
    """bccl groups created from now on in this process are planned (see supa_emu.plan.install)."""
    distributed.install_transport(UniformTransport)


def reduce_uniform(view: torch.Tensor, kind, size: int) -> None:
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


def _card_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == DEVICE_TYPE)


def uniform_sources(sent: List[int], received: List[int], rank: int, operation: str) -> List[int]:
    """For each source rank of an all_to_all, which of this rank's chunks stands for what it sends here.

    The rule: every rank sends this rank what this rank sends itself (chunk `rank`). Where the split
    sizes say otherwise but every rank sends as this one does, shifted by its rank (a permutation:
    ring attention passes its key/value shard to the next rank), rank j sends here what this rank
    sends to the rank as far after it as j is before it. Other splits depend on every rank's own
    data (MoE routing): flagged, and each chunk takes this rank's own where the sizes allow. An
    empty chunk guesses nothing (a routing the plan assumed sends this rank nothing from there)."""
    size = len(sent)
    if all(count in (sent[rank], 0) for count in received):
        return [rank] * size
    shifted = [(2 * rank - source) % size for source in range(size)]
    if all(received[source] == sent[shifted[source]] for source in range(size)):
        return shifted
    call_record.flag(f"{operation} with uneven splits: what each rank sends depends on its own data "
                     f"(e.g. MoE routing); chunks of another size keep their contents")
    return [rank] * size


def receive_chunks(chunks: List[torch.Tensor], sent: List[torch.Tensor], sources: List[int]) -> None:
    """An all_to_all's received chunks under the rule: source j's is this rank's sent chunk sources[j]."""
    for chunk, source in zip(chunks, sources):
        if chunk.numel() == sent[source].numel():
            chunk.copy_(sent[source].reshape(chunk.shape))


class UniformTransport(Transport):
    """The peers of a planned group, replaced by the uniform-rank rule."""

    def __init__(self, store: dist.Store, rank: int, size: int, options, label: str):
        world.admit(rank, size, options.global_ranks_in_group or range(size))
        self._rank, self._size, self._options = rank, size, options
        self._bytes_move = process_state.core()._card_bytes_move

    def _moves(self, call: Collective) -> bool:
        """Whether the call's data is moved (not in shapes mode above its size limit; see above)."""
        payload = max(_card_bytes(call.inputs), _card_bytes(call.outputs))
        return self._bytes_move(payload)

    def _done(self, call: Collective, host: Optional[HostCall] = None) -> BCCLWork:
        epilogue = host.epilogue() if host is not None else None
        return BCCLWork([], epilogue, call.results, (*call.inputs, *call.outputs))

    def _reduced(self, view: torch.Tensor, call: Collective) -> None:
        reduce_uniform(contribution(view, call.reduce_op, call.kind, in_place=True), call.kind, self._size)

    # ---- reductions ------------------------------------------------------------------------------
    def all_reduce(self, call: Collective) -> BCCLWork:
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        for tensor in call.inputs:
            self._reduced(host.view(tensor), call)
        return self._done(call, host)

    all_reduce_coalesced = all_reduce

    def reduce(self, call: Collective) -> BCCLWork:
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        for tensor in call.outputs:  # the root's; the others' stay intact
            self._reduced(host.view(tensor), call)
        return self._done(call, host)

    def reduce_scatter(self, call: Collective) -> BCCLWork:
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        out_view = host.view(call.outputs[0], read=False)
        out_view.copy_(host.view(call.inputs[self._rank], write=False).reshape(out_view.shape))
        self._reduced(out_view, call)
        return self._done(call, host)

    def reduce_scatter_tensor(self, call: Collective) -> BCCLWork:
        if not self._moves(call):
            return self._done(call)
        host, rank = HostCall(), self._rank
        for output, input in zip(call.outputs, call.inputs):
            out_view, in_view = host.pair_views(output, input, self._size, gather=False)
            chunk = out_view.numel()
            out_view.copy_(in_view[rank * chunk:(rank + 1) * chunk])
            self._reduced(out_view, call)
        return self._done(call, host)

    # ---- data movement ---------------------------------------------------------------------------
    def broadcast(self, call: Collective) -> BCCLWork:
        if not self._moves(call):
            return self._done(call)
        tensor, host = call.outputs[0], HostCall()
        value = world.root_value(self._options.group_name, host_view(tensor), self._rank == call.root)
        if value is not None:
            host.view(tensor, read=False).copy_(value.reshape(tensor.shape))
        return self._done(call, host)

    def all_gather(self, call: Collective) -> BCCLWork:
        for output in call.outputs:
            if output.numel() != call.inputs[0].numel():
                call_record.flag("all_gather with unequal sizes: the other ranks' slots keep their contents")
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        source = host.view(call.inputs[0], write=False)
        for output in call.outputs:
            if output.numel() == source.numel():
                host.view(output, read=False).copy_(source.reshape(output.shape))
        return self._done(call, host)

    def all_gather_into_tensor(self, call: Collective) -> BCCLWork:
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        for output, input in zip(call.outputs, call.inputs):
            out_view, in_view = host.pair_views(output, input, self._size, gather=True)
            out_view.view(self._size, -1).copy_(in_view.view(1, -1))
        return self._done(call, host)

    def gather(self, call: Collective) -> BCCLWork:
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        source = host.view(call.inputs[0], write=False)
        for output in call.outputs:  # the root's; none elsewhere
            host.view(output, read=False).copy_(source.reshape(output.shape))
        return self._done(call, host)

    def scatter(self, call: Collective) -> BCCLWork:
        host, output = HostCall(), call.outputs[0]
        if self._rank == call.root and self._moves(call):
            out_view = host.view(output, read=False)
            out_view.copy_(host.view(call.inputs[self._rank], write=False).reshape(out_view.shape))
        elif self._rank != call.root:
            call_record.flag("scatter: a non-root rank's output is the root's data; it keeps its contents")
        return self._done(call, host)

    def all_to_all(self, call: Collective) -> BCCLWork:
        sources = uniform_sources(*call.counts, self._rank, "all_to_all")
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        sent = [host.view(t, write=False) for t in call.inputs]
        receive_chunks([host.view(t, read=False) for t in call.outputs], sent, sources)
        return self._done(call, host)

    def all_to_all_single(self, call: Collective) -> BCCLWork:
        send, receive = call.counts
        sources = uniform_sources(send, receive, self._rank, "all_to_all_single")
        if not self._moves(call):
            return self._done(call)
        host = HostCall()
        sent = host.view(call.inputs[0], write=False).reshape(-1).split(send)
        out_view = host.view(call.outputs[0], read=False)
        receive_chunks(list(out_view.view(-1).split(receive)), sent, sources)
        return self._done(call, host)

    # ---- synchronisation and point-to-point ------------------------------------------------------
    def barrier(self, call: Collective) -> BCCLWork:
        return self._done(call)

    def send(self, call: Collective) -> BCCLWork:
        # The message log keeps it for a played receiver (p2p_messages.py), by global ranks.
        ranks = self._options.global_ranks_in_group or range(self._size)
        p2p_messages.send(self._options.group_name, ranks[self._rank], ranks[call.peer], call.tag,
                          host_view(call.inputs[0]))
        return self._done(call)

    def recv(self, call: Collective) -> BCCLWork:
        ranks, view = self._options.global_ranks_in_group or range(self._size), host_view(call.outputs[0])
        message = p2p_messages.receive(self._options.group_name, None if call.peer is None else ranks[call.peer],
                                       ranks[self._rank], call.tag, view)

        def deliver():  # when waited for, as a real recv completes: the sends of its batch come first
            received = message()
            if received is not None:
                view.copy_(received.reshape(view.shape))

        return BCCLWork([], deliver, call.results, (*call.inputs, *call.outputs))

    # ---- the group's life ------------------------------------------------------------------------
    def exchange_split(self, store: dist.Store, prefix: str, members: Optional[List[int]]) -> List[Optional[List[int]]]:
        # Every rank of a uniform world splits as this one does: each member posts these members.
        return [members if members is not None and r in members else None for r in range(self._size)]

    def close(self, how: str, error: dist.DistBackendError) -> None:
        pass  # no peers to release
