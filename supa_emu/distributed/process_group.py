"""ProcessGroupBCCL: torch.distributed collectives on emulated device tensors, run by gloo on host views, one method per c10d entry point.

Each call checks that its tensors live on the device, agrees with its peers on what is being run
(see signatures.py), then hands gloo CPU views that alias the device tensors' memory, so data moves
between ranks without a copy. Copies happen only where gloo cannot address the data in place:
a non-contiguous tensor is staged through a contiguous host buffer and written back afterwards.
Where gloo lacks an operation, or has a slow one, it is composed from gloo operations that exist:
  - AVG on integer dtypes: SUM, then truncating division by the group size.
  - all_reduce and reduce_scatter_tensor (and its coalesced form) with SUM, AVG, PRODUCT, MIN or
    MAX, and all_gather_into_tensor: one all-to-all each (see composed.py). The single-tensor
    all_gather_into_tensor is checked, agreed on and started in one native call where it can be
    (signatures.Agreement.launch): it is the collective ZeRO-3 and FSDP issue per parameter.
  - all_gather with unequal sizes: one broadcast per rank, straight into the outputs.
  - all_reduce_coalesced of mixed dtypes and the *_coalesced tensor variants (absent on gloo's
    backend): one gloo operation per tensor, in flight together, completing as one work.
Point-to-point operations are not signature-checked (peers are not in lockstep).
Each call's checked operands come from operands.py (shared with the planner's group), the
agreement step from signatures.py, the all-to-all based compositions and the stand-in for refused
collectives from composed.py; this module is the dispatch to gloo, one method per c10d collective
entry point, which is why it stays one class of a little over 400 lines.
"""

import sys
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from . import (call_record, composed, gloo_handoff, host_memory, operands, profiling, self_p2p, signature_exchange,
               signatures)
from .arguments import check_dtypes, check_sizes, numel as _numel, pairs, require_device, single
from .arguments import check_reduce_op as _check_reduce_op, check_reduction, reduce_kind as _reduce_kind
from .c10d_backend import DEFAULT_TIMEOUT, C10dBackend
from .host_memory import HostCall
from supa_emu.supa import _sanitizer_switch as _sanitizer
from .work import BCCLWork, combine

BACKEND_NAME = "bccl"

_RedOp = dist.ReduceOp.RedOpType
_PER_OPERATION_OPTIONS = {
    "allreduce": dist.AllreduceOptions,
    "reduce": dist.ReduceOptions,
    "reduce_scatter": dist.ReduceScatterOptions,
}


def _flat(view: torch.Tensor) -> torch.Tensor:
    # gloo wants flat buffers; views of contiguous buffers reshape without copying.
    return view if view.dim() == 1 else view.view(-1)


def _gather_signature(operation: str, outputs, inputs) -> List[int]:
    return signatures.make(
        operation, inputs[0].dtype if inputs else None, numel_in=sum(_numel(inputs)),
        numel_out=sum(_numel(outputs)), shape_digest=signatures.digest(_numel(inputs)))


class ProcessGroupBCCL(C10dBackend, dist.ProcessGroup):
    """A whole process group (not a c10d Backend): torch calls these methods directly (the
    backend attributes c10d reads come from C10dBackend)."""

    def __init__(self, store: dist.Store, rank: int, size: int, options: "ProcessGroupBCCL.Options"):
        super().__init__(rank, size)
        self.options = options
        self._store = store
        self._label = repr(options.group_name or "default")
        timeout = options._timeout
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("bccl/gloo", store), rank, size, timeout)
        self._agreement = signatures.Agreement(
            signature_exchange.create(store, rank, size, timeout, self._label), rank, size, self._label,
            self._stand_in)
        self._coalesced: Optional[List[BCCLWork]] = None
        self._init_backend_state()
        self._to_self = self_p2p.SelfMailbox(self._label)

    # ---- identity ----------------------------------------------------------------------------
    # c10d keeps a group's name in its c10d Backends, which this whole-group plugin has none of;
    # without these, `group.group_name` (read by DeviceMesh and FSDP) raises "name not set".
    @property
    def group_name(self) -> str:
        return self.options.group_name

    def _set_group_name(self, name: str) -> None:
        self.options.group_name = name

    def _get_backend(self, device: torch.device):
        # This whole group is the backend of its supa tensors (c10d's lookup table is empty).
        if torch.device(device).type == host_memory.DEVICE_TYPE:
            return self
        return super()._get_backend(device)

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    @property
    def _device_types(self) -> List[torch.device]:
        # Object collectives (all_gather_object, broadcast_object_list) stage on this device.
        return [host_memory.device()]

    # ---- shared steps --------------------------------------------------------------------------
    def _finish(self, parts, call: HostCall, outputs: Sequence[torch.Tensor] = (), ticket=None,
                collective: bool = True) -> BCCLWork:
        if collective and self._coalesced is None:
            self._sequence += 1  # a coalesced block counts once, at its start
        gloo_handoff.hold(parts)
        issuer = sys._getframe(1)  # the collective entry point: named by the recorder, profiler and sanitizer
        if call_record.active():
            call_record.note_call(self.size(), call, issuer)
        record = profiling.open_range(BACKEND_NAME, issuer.f_code.co_name)
        if record is not None:
            profiling.close_on_completion(record, parts)
        work = BCCLWork(parts, call.epilogue(), outputs, call.device_tensors, self._agreement, ticket)
        sanitizer = _sanitizer.active()
        if sanitizer is not None:
            accesses = [(t, r, w) for t, (r, w) in zip(call.device_tensors, call.access_modes)]
            sanitizer.collective_issued(work, self._label, accesses, issuer.f_code.co_name)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _stand_in(self, signature: List[int]) -> None:
        composed.stand_in(self._gloo, signature, self._gloo_op_for)

    def _gloo_op_for(self, kind: _RedOp, dtype: torch.dtype):
        """The op gloo runs for `kind` (a composed AVG's fix-up is not needed on scratch buffers)."""
        return self._gloo_reduce_op(kind, dtype, HostCall(), lambda: [])

    def _gloo_reduce_op(self, kind: _RedOp, dtype: torch.dtype, call: HostCall, result: Callable):
        """The op gloo runs for `kind`, registering the fix-up that completes a composed AVG."""
        _check_reduce_op(kind, dtype)
        if kind == _RedOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
            size = self.size()
            # Integer average as the device libraries define it: the sum, truncated toward zero.
            call.after(lambda: [t.div_(size, rounding_mode="trunc") for t in result()])
            return dist.ReduceOp.SUM
        if kind == _RedOp.PREMUL_SUM:
            return dist.ReduceOp.SUM  # the contributions were premultiplied (composed.premultiply)
        return dist.ReduceOp(kind)

    def _options(self, kind: str, opts, reduce_op) -> object:
        if reduce_op is None or _reduce_kind(opts.reduceOp) == _reduce_kind(reduce_op):
            return opts
        fresh = _PER_OPERATION_OPTIONS[kind]()
        for field in ("rootRank", "rootTensor", "timeout"):
            if hasattr(opts, field):
                setattr(fresh, field, getattr(opts, field))
        fresh.reduceOp = reduce_op
        return fresh

    def _pair_operands(self, output, input, operation: str, call: HostCall, gather: bool):
        """Flat host views of one output/input pair of an all_gather (gather=True) or of a
        reduce_scatter, for gloo."""
        size = self.size()
        if isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor):
            plain = host_memory.plain_pair_operands(output, input, size, gather)
            if plain is not None:
                call.track(output, read=False)
                call.track(input, write=False)
                return plain
        # Not the plain case: the checks say what is wrong; other layouts are staged.
        require_device([output], "output")
        require_device([input], "input")
        if gather:
            check_sizes(output.numel(), input.numel() * size, size, operation, input, output)
        else:
            check_sizes(input.numel(), output.numel() * size, size, operation, input, output)
        check_dtypes(output, input, operation)
        return _flat(call.view(output, read=False)), _flat(call.view(input, write=False))

    def _pairs_operands(self, outputs, inputs, operation: str, call: HostCall, gather: bool):
        """`_pair_operands` of every output/input pair of a tensor-list all_gather or reduce_scatter."""
        return [self._pair_operands(output, input, operation, call, gather)
                for output, input in pairs(outputs, inputs, operation)]

    # ---- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        tensor, kind, opts = operands.all_reduce(tensors, opts)
        ticket = self._agreement.agree(
            signatures.make("all_reduce", tensor.dtype, int(kind), numel_in=tensor.numel()), early=True)
        call = HostCall()
        view = composed.premultiplied(call.elementwise_view(tensor), opts.reduceOp, in_place=True)
        if composed.all_reduce_exchanges(kind, tensor.dtype, tensor.numel(), self.size()):
            part = composed.all_reduce(self._gloo, _flat(view), kind, call, opts.timeout)
        else:
            gloo_op = self._gloo_reduce_op(kind, tensor.dtype, call, lambda: [view])
            part = self._gloo.allreduce([view], self._options("allreduce", opts, gloo_op))
        return self._finish([part], call, [tensor], ticket)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        require_device(tensors, "input")
        kind = _reduce_kind(opts.reduceOp)
        for tensor in tensors:
            check_reduction(opts.reduceOp, tensor.dtype)
        layout = [n for t in tensors for n in (signatures.dtype_code(t.dtype), t.numel())]
        self._agreement.agree(
            signatures.make(
                "all_reduce_coalesced", None, int(kind), numel_in=sum(_numel(tensors)),
                shape_digest=signatures.digest(layout),
            )
        )
        call, parts = HostCall(), []
        for tensor in tensors:
            view = composed.premultiplied(call.view(tensor), opts.reduceOp, in_place=True)
            gloo_op = self._gloo_reduce_op(kind, tensor.dtype, call, lambda view=view: [view])
            options = dist.AllreduceOptions()
            options.reduceOp, options.timeout = gloo_op, opts.timeout
            parts.append(self._gloo.allreduce([view], options))
        return self._finish(parts, call, tensors)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        tensor = single(tensors, "input")
        kind, root = check_reduction(opts.reduceOp, tensor.dtype), opts.rootRank
        self._agreement.agree(signatures.make("reduce", tensor.dtype, int(kind), root, tensor.numel()))
        call = HostCall()
        if self.rank() == root:
            view = composed.premultiplied(call.view(tensor), opts.reduceOp, in_place=True)
            gloo_op = self._gloo_reduce_op(kind, tensor.dtype, call, lambda: [view])
        else:
            # gloo may use a non-root buffer as scratch; the device backends leave it intact.
            view = call.view(tensor, write=False).clone(memory_format=torch.contiguous_format)
            view = composed.premultiplied(view, opts.reduceOp, in_place=True)
            gloo_op = self._gloo_reduce_op(kind, tensor.dtype, HostCall(), lambda: [])
        part = self._gloo.reduce([view], self._options("reduce", opts, gloo_op))
        return self._finish([part], call, [tensor])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        output, inputs = operands.reduce_scatter(outputs, input_lists, self.size(), self.rank())
        kind = check_reduction(opts.reduceOp, output.dtype)
        self._agreement.agree(
            signatures.make(
                "reduce_scatter", output.dtype, int(kind), shape_digest=signatures.digest(_numel(inputs))
            )
        )
        call = HostCall()
        out_view = call.view(output, read=False)
        in_views = [composed.premultiplied(call.view(t, write=False), opts.reduceOp, in_place=False) for t in inputs]
        gloo_op = self._gloo_reduce_op(kind, output.dtype, call, lambda: [out_view])
        part = self._gloo.reduce_scatter([out_view], [in_views], self._options("reduce_scatter", opts, gloo_op))
        return self._finish([part], call, [output])

    def reduce_scatter_single(self, output, input, opts=None):
        return self._reduce_scatter_tensors([output], [input], opts, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_tensors(outputs, inputs, opts, "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_tensors(self, outputs, inputs, opts, operation):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        call = HostCall()
        views = self._pairs_operands(outputs, inputs, operation, call, False)
        kind = _reduce_kind(opts.reduceOp)
        if outputs:
            check_reduction(opts.reduceOp, outputs[0].dtype)
        ticket = self._agreement.agree(
            signatures.make(
                operation, outputs[0].dtype if outputs else None, int(kind),
                numel_in=sum(_numel(inputs)), numel_out=sum(_numel(outputs)),
                shape_digest=signatures.digest(_numel(outputs)),
            ),
            early=operation == "reduce_scatter_tensor",
        )
        parts = []
        for output, (out_view, in_view) in zip(outputs, views):
            in_view = composed.premultiplied(in_view, opts.reduceOp, in_place=False)
            if composed.reduces_locally(kind, output.dtype):
                parts.append(composed.reduce_scatter(self._gloo, out_view, in_view, kind, call, opts.timeout))
                continue
            gloo_op = self._gloo_reduce_op(kind, output.dtype, call, lambda v=out_view: [v])
            parts.append(self._gloo._reduce_scatter_base(out_view, in_view, self._options("reduce_scatter", opts, gloo_op)))
        return self._finish(parts, call, outputs, ticket)

    # ---- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        tensor, opts = operands.broadcast(tensors, opts)
        ticket = self._agreement.agree(
            signatures.make("broadcast", tensor.dtype, root=opts.rootRank, numel_in=tensor.numel()), early=True)
        call = HostCall()
        view = call.view(tensor, read=self.rank() == opts.rootRank)
        return self._finish([self._gloo.broadcast([view], opts)], call, [tensor], ticket)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        input, outputs = operands.all_gather(output_lists, inputs, self.size(), self.rank())
        sizes = _numel(outputs)
        self._agreement.agree(signatures.make("all_gather", input.dtype, shape_digest=signatures.digest(sizes)))
        call = HostCall()
        out_views = [call.view(t, read=False) for t in outputs]
        if len(set(sizes)) == 1:
            parts = [self._gloo.allgather([out_views], [call.view(input, write=False)], opts)]
        else:
            # gloo's all_gather wants equal sizes; a broadcast from each rank fills its own slot.
            out_views[self.rank()].copy_(host_memory.host_view(input).reshape(out_views[self.rank()].shape))
            parts = []
            for root, view in enumerate(out_views):
                options = dist.BroadcastOptions()
                options.rootRank, options.timeout = root, opts.timeout
                parts.append(self._gloo.broadcast([view], options))
        return self._finish(parts, call, outputs)

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        if isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor):
            # The hot call (ZeRO-3 and FSDP gather every parameter with it): the operand check, the
            # agreement and gloo's start in one native call where the group's board allows.
            launched = self._agreement.launch(
                _gather_signature("all_gather_into_tensor", [output], [input]), host_memory.launch_all_gather,
                self._gloo, output, input, opts)
            if launched is not None:
                ticket, part = launched
                call = HostCall()
                call.track(output, read=False)
                call.track(input, write=False)
                return self._finish([part], call, [output], ticket)
        return self._all_gather_tensors([output], [input], opts, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_tensors(outputs, inputs, opts, "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_tensors(self, outputs, inputs, opts, operation):
        opts = opts if opts is not None else AllgatherOptions()
        call = HostCall()
        views = self._pairs_operands(outputs, inputs, operation, call, True)
        ticket = self._agreement.agree(
            _gather_signature(operation, outputs, inputs), early=operation == "all_gather_into_tensor")
        parts = [host_memory.start_all_gather(self._gloo, output, input, opts) for output, input in views]
        return self._finish(parts, call, outputs, ticket)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's layout: output_lists[r][i] receives rank r's inputs[i].
        require_device(inputs, "input")
        works = []
        with self._coalescing_paused():
            for i, input in enumerate(inputs):
                works.append(self.allgather([[outputs[i] for outputs in output_lists]], [input], opts))
        work = combine(works)
        self._sequence -= len(works)  # the all_gathers above are parts of this one collective
        if self._coalesced is not None:
            self._coalesced.append(work)
        else:
            self._sequence += 1
        return work

    def gather(self, output_lists, inputs, opts=None):
        input, outputs, is_root, opts = operands.gather(output_lists, inputs, opts, self.size(), self.rank())
        self._agreement.agree(signatures.make("gather", input.dtype, root=opts.rootRank, numel_in=input.numel()))
        call = HostCall()
        out_views = [[call.view(t, read=False) for t in outputs]] if is_root else []
        part = self._gloo.gather(out_views, [call.view(input, write=False)], opts)
        return self._finish([part], call, outputs)

    def scatter(self, outputs, input_lists, opts=None):
        output, inputs, is_root, opts = operands.scatter(outputs, input_lists, opts, self.size(), self.rank())
        self._agreement.agree(signatures.make("scatter", output.dtype, root=opts.rootRank, numel_out=output.numel()))
        call = HostCall()
        in_views = [[call.view(t, write=False) for t in inputs]] if is_root else []
        part = self._gloo.scatter([call.view(output, read=False)], in_views, opts)
        return self._finish([part], call, [output])

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        operands.all_to_all(outputs, inputs, self.size())
        self._agreement.agree_all_to_all("all_to_all", inputs[0].dtype, _numel(inputs), _numel(outputs))
        call = HostCall()
        out_views = [call.view(t, read=False) for t in outputs]
        in_views = [call.view(t, write=False) for t in inputs]
        if len(set(_numel(outputs) + _numel(inputs))) == 1:
            return self._finish([self._gloo.alltoall(out_views, in_views, opts)], call, outputs)
        # gloo's list all_to_all wants equal sizes: pack into one buffer, exchange, unpack.
        send = torch.cat([view.reshape(-1) for view in in_views])
        received = torch.empty(sum(_numel(outputs)), dtype=send.dtype)
        counts = _numel(outputs)

        def unpack():
            for view, chunk in zip(out_views, received.split(counts)):
                view.copy_(chunk.view(view.shape))

        call.after(unpack)
        part = self._gloo.alltoall_base(received, send, counts, _numel(inputs), opts)
        return self._finish([part], call, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        send, receive = operands.all_to_all_single(output, input, output_split_sizes, input_split_sizes, self.size())
        self._agreement.agree_all_to_all("all_to_all_single", input.dtype, send, receive)
        call = HostCall()
        part = self._gloo.alltoall_base(
            call.view(output, read=False), call.view(input, write=False),
            list(output_split_sizes), list(input_split_sizes), opts,
        )
        return self._finish([part], call, [output])

    alltoall_base = all_to_all_single

    # ---- synchronisation and point-to-point -------------------------------------------------
    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        ticket = self._agreement.agree(signatures.make("barrier"), early=True)
        options = dist.BarrierOptions()
        options.timeout = opts.timeout
        return self._finish([self._gloo.barrier(options)], HostCall(), (), ticket)

    def send(self, tensors, dst_rank, tag=0):
        tensor = single(tensors, "tensor")
        if dst_rank == self.rank():
            return self._to_self.send(tensor, tag)  # gloo has no connection to its own rank
        call = HostCall()
        part = self._gloo.send([call.view(tensor, write=False)], dst_rank, tag)
        return self._finish([part], call, collective=False)

    def recv(self, tensors, src_rank, tag=0):
        tensor = single(tensors, "tensor")
        if src_rank == self.rank():
            return self._to_self.recv(tensor, tag)
        call = HostCall()
        part = self._gloo.recv([call.view(tensor, read=False)], src_rank, tag)
        return self._finish([part], call, [tensor], collective=False)

    def recv_anysource(self, tensors, tag=0):
        tensor = single(tensors, "tensor")
        call = HostCall()
        part = self._gloo.recv_anysource([call.view(tensor, read=False)], tag)
        work = self._finish([part], call, [tensor], collective=False)
        work._keeps_parts = True  # source_rank() asks the gloo part, after the wait
        return work

    # ---- coalescing (torch.distributed._coalescing_manager with a device) ------------------
    def _start_coalescing(self, device=None) -> None:
        if self._coalesced is not None:
            raise RuntimeError("bccl: coalescing already started on this group")
        self._sequence += 1
        self._coalesced = []

    def _end_coalescing(self, device=None) -> BCCLWork:
        if self._coalesced is None:
            raise RuntimeError("bccl: _end_coalescing without _start_coalescing")
        works, self._coalesced = self._coalesced, None
        return combine(works)

    class _Paused:
        def __init__(self, group):
            self.group = group

        def __enter__(self):
            self.saved, self.group._coalesced = self.group._coalesced, None

        def __exit__(self, *exc):
            self.group._coalesced = self.saved

    def _coalescing_paused(self):
        return self._Paused(self)
