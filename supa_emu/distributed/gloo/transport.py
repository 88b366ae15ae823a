"""The transport between real ranks: agree with the peers on each call, then run it on gloo over host views.

Each collective first posts its signature and checks its peers' (signatures.Agreement: a
mismatch raises instead of crashing a rank inside gloo), then hands gloo CPU views that alias the
device tensors' memory, so data moves between ranks without a copy. Copies happen only where
gloo cannot address the data in place: a non-contiguous tensor is staged through a contiguous
host buffer and written back afterwards (host_memory.HostCall). Where gloo lacks an operation,
or has a slow one, it is composed from gloo operations that exist:
  - AVG on integer dtypes: SUM, then truncating division by the group size.
  - all_reduce and reduce_scatter_tensor (and its coalesced form) with SUM, AVG, PRODUCT, MIN or
    MAX, and all_gather_into_tensor: one all-to-all each (composed.py). The single-tensor
    all_gather_into_tensor is agreed on and started in one native call where it can be
    (signatures.Agreement.launch): it is the collective ZeRO-3 and FSDP issue per parameter.
  - all_gather with unequal sizes: one broadcast per rank, straight into the outputs.
  - all_reduce_coalesced and the *_coalesced tensor variants (absent on gloo's backend): one gloo
    operation per tensor, in flight together, completing as one work.
  - send to and receive from the rank itself, which gloo has no connection for (self_p2p.py).
Point-to-point operations are not agreed on (peers are not in lockstep).
"""

import json
import weakref
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from .. import host_memory
from ..collective import Collective
from ..host_memory import HostCall
from ..transport import Transport
from . import composed, handoff, self_p2p, signature_exchange, signatures
from .work import GlooWork

_RedOp = dist.ReduceOp.RedOpType
_PER_OPERATION_OPTIONS = {
    "allreduce": dist.AllreduceOptions,
    "reduce": dist.ReduceOptions,
    "reduce_scatter": dist.ReduceScatterOptions,
}


def _options(operation: str, call: Collective, gloo_kind: _RedOp) -> object:
    """The call's options for gloo's `operation`, reducing by `gloo_kind` (a copy if the call's
    reduction is another)."""
    opts = call.options
    if call.kind == gloo_kind:
        return opts
    fresh = _PER_OPERATION_OPTIONS[operation]()
    for field in ("rootRank", "rootTensor", "timeout"):
        if hasattr(opts, field):
            setattr(fresh, field, getattr(opts, field))
    fresh.reduceOp = dist.ReduceOp(gloo_kind)
    return fresh


def _numel(tensors) -> List[int]:
    return list(map(torch.Tensor.numel, tensors))  # no comprehension: one Python call, not two


def _gather_signature(call: Collective) -> List[int]:
    sizes_in = _numel(call.inputs)
    return signatures.make(call.op, call.inputs[0].dtype if call.inputs else None, numel_in=sum(sizes_in),
                           numel_out=sum(map(torch.Tensor.numel, call.outputs)),
                           shape_digest=signatures.digest(sizes_in))


def _contribution(call: Collective, view: torch.Tensor, in_place: bool) -> torch.Tensor:
    return host_memory.contribution(view, call.reduce_op, call.kind, in_place)


class GlooTransport(Transport):
    """One group's gloo group, its agreement step and its mailbox for messages to itself."""

    def __init__(self, store: dist.Store, rank: int, size: int, options, label: str):
        self._rank, self._size = rank, size
        timeout = options._timeout
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("bccl/gloo", store), rank, size, timeout)
        self._agreement = signatures.Agreement(
            signature_exchange.create(store, rank, size, timeout, label), rank, size, label, self._stand_in)
        self._to_self = self_p2p.SelfMailbox(label)
        self._started_works: "weakref.WeakSet[GlooWork]" = weakref.WeakSet()  # what close() fails

    def _started(self, call: Collective, parts, host: Optional[HostCall] = None, ticket=None) -> GlooWork:
        handoff.hold(parts)
        epilogue = host.epilogue() if host is not None else None
        work = GlooWork(parts, epilogue, call.results, (*call.inputs, *call.outputs), self._agreement, ticket)
        self._started_works.add(work)
        return work

    def _reduce_op(self, kind: _RedOp, dtype: torch.dtype, host: Optional[HostCall] = None,
                   result: Callable = None) -> _RedOp:
        """The reduction gloo runs for `kind`, registering with `host` the fix-up that completes a
        composed AVG of the tensors `result()` returns (none without `host`: scratch buffers)."""
        if kind == _RedOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
            if host is not None:
                size = self._size
                # Integer average as the device libraries define it: the sum, truncated toward zero.
                host.after(lambda: [t.div_(size, rounding_mode="trunc") for t in result()])
            return _RedOp.SUM
        if kind == _RedOp.PREMUL_SUM:
            return _RedOp.SUM  # the contributions were premultiplied
        return kind

    # ---- reductions ------------------------------------------------------------------------------
    def all_reduce(self, call: Collective) -> GlooWork:
        tensor, kind = call.inputs[0], call.kind
        ticket = self._agreement.agree(
            signatures.make("all_reduce", tensor.dtype, int(kind), numel_in=tensor.numel()), early=True)
        host = HostCall()
        view = host.elementwise_view(tensor)
        if kind == _RedOp.PREMUL_SUM:
            view = _contribution(call, view, in_place=True)
        if composed.all_reduce_exchanges(kind, tensor.dtype, tensor.numel(), self._size):
            part = composed.all_reduce(self._gloo, host_memory.flat(view), kind, host, call.options.timeout)
        else:
            gloo_op = self._reduce_op(kind, tensor.dtype, host, lambda: [view])
            part = self._gloo.allreduce([view], _options("allreduce", call, gloo_op))
        return self._started(call, [part], host, ticket)

    def all_reduce_coalesced(self, call: Collective) -> GlooWork:
        tensors, kind = call.inputs, call.kind
        layout = [n for t in tensors for n in (signatures.dtype_code(t.dtype), t.numel())]
        self._agreement.agree(signatures.make("all_reduce_coalesced", None, int(kind), numel_in=sum(_numel(tensors)),
                                              shape_digest=signatures.digest(layout)))
        host, parts = HostCall(), []
        for tensor in tensors:
            view = _contribution(call, host.view(tensor), in_place=True)
            options = dist.AllreduceOptions()
            options.reduceOp = self._reduce_op(kind, tensor.dtype, host, lambda view=view: [view])
            options.timeout = call.options.timeout
            parts.append(self._gloo.allreduce([view], options))
        return self._started(call, parts, host)

    def reduce(self, call: Collective) -> GlooWork:
        tensor, kind, root = call.inputs[0], call.kind, call.root
        self._agreement.agree(signatures.make("reduce", tensor.dtype, int(kind), root, tensor.numel()))
        host = HostCall()
        if self._rank == root:
            view = _contribution(call, host.view(tensor), in_place=True)
            gloo_op = self._reduce_op(kind, tensor.dtype, host, lambda: [view])
        else:
            # gloo may use a non-root buffer as scratch; the device backends leave it intact.
            view = host.view(tensor, write=False).clone(memory_format=torch.contiguous_format)
            view = _contribution(call, view, in_place=True)
            gloo_op = self._reduce_op(kind, tensor.dtype)
        part = self._gloo.reduce([view], _options("reduce", call, gloo_op))
        return self._started(call, [part], host)

    def reduce_scatter(self, call: Collective) -> GlooWork:
        output, inputs, kind = call.outputs[0], call.inputs, call.kind
        self._agreement.agree(signatures.make(
            "reduce_scatter", output.dtype, int(kind), shape_digest=signatures.digest(_numel(inputs))))
        host = HostCall()
        out_view = host.view(output, read=False)
        in_views = [_contribution(call, host.view(t, write=False), in_place=False) for t in inputs]
        gloo_op = self._reduce_op(kind, output.dtype, host, lambda: [out_view])
        part = self._gloo.reduce_scatter([out_view], [in_views], _options("reduce_scatter", call, gloo_op))
        return self._started(call, [part], host)

    def reduce_scatter_tensor(self, call: Collective) -> GlooWork:
        outputs, inputs, kind = call.outputs, call.inputs, call.kind
        host = HostCall()
        views = [host.pair_views(output, input, self._size, gather=False) for output, input in zip(outputs, inputs)]
        sizes_out = _numel(outputs)
        ticket = self._agreement.agree(
            signatures.make(
                call.op, outputs[0].dtype if outputs else None, int(kind),
                numel_in=sum(map(torch.Tensor.numel, inputs)), numel_out=sum(sizes_out),
                shape_digest=signatures.digest(sizes_out)),
            early=call.op == "reduce_scatter_tensor")
        parts = []
        for output, (out_view, in_view) in zip(outputs, views):
            if kind == _RedOp.PREMUL_SUM:
                in_view = _contribution(call, in_view, in_place=False)
            if composed.reduces_locally(kind, output.dtype):
                parts.append(composed.reduce_scatter(self._gloo, out_view, in_view, kind, host, call.options.timeout))
                continue
            gloo_op = self._reduce_op(kind, output.dtype, host, lambda v=out_view: [v])
            parts.append(self._gloo._reduce_scatter_base(
                out_view, in_view, _options("reduce_scatter", call, gloo_op)))
        return self._started(call, parts, host, ticket)

    # ---- data movement ---------------------------------------------------------------------------
    def broadcast(self, call: Collective) -> GlooWork:
        tensor, root = call.outputs[0], call.root
        ticket = self._agreement.agree(
            signatures.make("broadcast", tensor.dtype, root=root, numel_in=tensor.numel()), early=True)
        host = HostCall()
        view = host.view(tensor, read=self._rank == root)
        return self._started(call, [self._gloo.broadcast([view], call.options)], host, ticket)

    def all_gather(self, call: Collective) -> GlooWork:
        input, outputs = call.inputs[0], call.outputs
        sizes = _numel(outputs)
        self._agreement.agree(signatures.make("all_gather", input.dtype, shape_digest=signatures.digest(sizes)))
        host = HostCall()
        out_views = [host.view(t, read=False) for t in outputs]
        if len(set(sizes)) == 1:
            parts = [self._gloo.allgather([out_views], [host.view(input, write=False)], call.options)]
        else:
            # gloo's all_gather wants equal sizes; a broadcast from each rank fills its own slot.
            mine = out_views[self._rank]
            mine.copy_(host_memory.host_view(input).reshape(mine.shape))
            parts = []
            for root, view in enumerate(out_views):
                options = dist.BroadcastOptions()
                options.rootRank, options.timeout = root, call.options.timeout
                parts.append(self._gloo.broadcast([view], options))
        return self._started(call, parts, host)

    def all_gather_into_tensor(self, call: Collective) -> GlooWork:
        if call.op == "all_gather_into_tensor":
            # The hot call (ZeRO-3 and FSDP gather every parameter with it): the agreement and
            # gloo's start in one native call where the group's board allows.
            launched = self._agreement.launch(_gather_signature(call), composed.launch_all_gather, self._gloo,
                                              call.outputs[0], call.inputs[0], call.options)
            if launched is not None:
                ticket, part = launched
                return self._started(call, [part], None, ticket)
        host = HostCall()
        views = [host.pair_views(output, input, self._size, gather=True)
                 for output, input in zip(call.outputs, call.inputs)]
        ticket = self._agreement.agree(_gather_signature(call), early=call.op == "all_gather_into_tensor")
        parts = [composed.start_all_gather(self._gloo, output, input, call.options) for output, input in views]
        return self._started(call, parts, host, ticket)

    def gather(self, call: Collective) -> GlooWork:
        input, outputs = call.inputs[0], call.outputs
        self._agreement.agree(signatures.make("gather", input.dtype, root=call.root, numel_in=input.numel()))
        host = HostCall()
        out_views = [[host.view(t, read=False) for t in outputs]] if self._rank == call.root else []
        part = self._gloo.gather(out_views, [host.view(input, write=False)], call.options)
        return self._started(call, [part], host)

    def scatter(self, call: Collective) -> GlooWork:
        output, inputs = call.outputs[0], call.inputs
        self._agreement.agree(signatures.make("scatter", output.dtype, root=call.root, numel_out=output.numel()))
        host = HostCall()
        in_views = [[host.view(t, write=False) for t in inputs]] if self._rank == call.root else []
        part = self._gloo.scatter([host.view(output, read=False)], in_views, call.options)
        return self._started(call, [part], host)

    def all_to_all(self, call: Collective) -> GlooWork:
        outputs, inputs = call.outputs, call.inputs
        sent, received_counts = call.counts
        self._agreement.agree_all_to_all("all_to_all", inputs[0].dtype, sent, received_counts)
        host = HostCall()
        out_views = [host.view(t, read=False) for t in outputs]
        in_views = [host.view(t, write=False) for t in inputs]
        if len(set(sent + received_counts)) == 1:
            return self._started(call, [self._gloo.alltoall(out_views, in_views, call.options)], host)
        # gloo's list all_to_all wants equal sizes: pack into one buffer, exchange, unpack.
        send = torch.cat([view.reshape(-1) for view in in_views])
        received = torch.empty(sum(received_counts), dtype=send.dtype)

        def unpack():
            for view, chunk in zip(out_views, received.split(received_counts)):
                view.copy_(chunk.view(view.shape))

        host.after(unpack)
        part = self._gloo.alltoall_base(received, send, received_counts, sent, call.options)
        return self._started(call, [part], host)

    def all_to_all_single(self, call: Collective) -> GlooWork:
        output, input = call.outputs[0], call.inputs[0]
        send, receive = call.counts
        self._agreement.agree_all_to_all("all_to_all_single", input.dtype, send, receive)
        host = HostCall()
        output_splits, input_splits = call.splits
        part = self._gloo.alltoall_base(host.view(output, read=False), host.view(input, write=False),
                                        output_splits, input_splits, call.options)
        return self._started(call, [part], host)

    # ---- synchronisation and point-to-point ------------------------------------------------------
    def barrier(self, call: Collective) -> GlooWork:
        ticket = self._agreement.agree(signatures.make("barrier"), early=True)
        options = dist.BarrierOptions()
        options.timeout = call.options.timeout
        return self._started(call, [self._gloo.barrier(options)], None, ticket)

    def send(self, call: Collective) -> GlooWork:
        tensor = call.inputs[0]
        if call.peer == self._rank:
            return self._to_self.send(tensor, call.tag)
        host = HostCall()
        return self._started(call, [self._gloo.send([host.view(tensor, write=False)], call.peer, call.tag)], host)

    def recv(self, call: Collective) -> GlooWork:
        tensor = call.outputs[0]
        if call.peer == self._rank:
            return self._to_self.recv(tensor, call.tag)
        host = HostCall()
        view = host.view(tensor, read=False)
        if call.peer is not None:
            return self._started(call, [self._gloo.recv([view], call.peer, call.tag)], host)
        work = self._started(call, [self._gloo.recv_anysource([view], call.tag)], host)
        work.keeps_parts = True  # source_rank() asks the gloo part, after the wait
        return work

    # ---- the group's life ------------------------------------------------------------------------
    def exchange_split(self, store: dist.Store, prefix: str, members: Optional[List[int]]) -> List[Optional[List[int]]]:
        store.set(f"{prefix}member/{self._rank}", json.dumps(members))
        return [json.loads(store.get(f"{prefix}member/{r}")) for r in range(self._size)]

    def close(self, how: str, error: dist.DistBackendError) -> None:
        for work in list(self._started_works):
            work.abandon(error)
        self._agreement.close(error)
        if how == "aborted":
            self._gloo.abort()
        else:
            self._gloo.shutdown()

    def _stand_in(self, signature: List[int]) -> None:
        """Run, on scratch buffers, the gloo operation of the collective `signature` describes:
        this rank refused a collective its peers already started (signatures.Agreement), and
        theirs must finish with every rank's gloo at the same collective.

        Only collectives that may start before all ranks agree ever need this; their signatures
        name all it takes.
        """
        operation, dtype, kind, root, numel_in, numel_out = signatures.decode(signature)
        gloo, size = self._gloo, self._size
        exchanged = operation == "all_reduce" and composed.all_reduce_exchanges(_RedOp(kind), dtype, numel_in, size)
        scratch = torch.zeros((size - 1 if exchanged else 1) * numel_in, dtype=dtype)
        if exchanged:  # the peers sent `numel_in` elements to every other rank and expect as many back
            splits = composed.exchange_splits(self._rank, size, numel_in)
            work = gloo.alltoall_base(torch.empty_like(scratch), scratch, splits, splits, dist.AllToAllOptions())
        elif operation == "all_gather_into_tensor":
            work = composed.start_all_gather(gloo, torch.empty(numel_out, dtype=dtype), scratch, AllgatherOptions())
        elif operation == "all_reduce":
            options = dist.AllreduceOptions()
            options.reduceOp = self._reduce_op(_RedOp(kind), dtype)
            work = gloo.allreduce([scratch], options)
        elif operation == "broadcast":
            options = dist.BroadcastOptions()
            options.rootRank = root
            work = gloo.broadcast([scratch], options)
        elif operation == "reduce_scatter_tensor" and composed.reduces_locally(_RedOp(kind), dtype):
            work = gloo.alltoall_base(torch.empty_like(scratch), scratch, [], [], dist.AllToAllOptions())
        elif operation == "reduce_scatter_tensor":
            options = dist.ReduceScatterOptions()
            options.reduceOp = self._reduce_op(_RedOp(kind), dtype)
            work = gloo._reduce_scatter_base(torch.empty(numel_out, dtype=dtype), scratch, options)
        elif operation == "barrier":
            work = gloo.barrier()
        else:
            raise AssertionError(f"bccl: {operation} never starts before all ranks agree")
        handoff.hold([work])
        work.wait()
