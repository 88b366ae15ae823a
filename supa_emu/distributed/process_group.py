"""ProcessGroupBCCL: torch.distributed collectives on emulated device tensors, run by gloo on host views.

Each call checks that its tensors live on the device, agrees with its peers on what is being run
(see signatures.py), then hands gloo CPU views that alias the device tensors' memory, so data moves
between ranks without a copy. Copies happen only where gloo cannot address the data in place:
a non-contiguous tensor is staged through a contiguous host buffer and written back afterwards.
Where gloo lacks an operation it is composed from gloo operations that exist:
  - AVG on integer dtypes: SUM, then truncating division by the group size.
  - all_gather with unequal sizes: one broadcast per rank, straight into the outputs.
  - all_reduce_coalesced of mixed dtypes and the *_coalesced tensor variants (absent on gloo's
    backend): one gloo operation per tensor, in flight together, completing as one work.
Point-to-point operations are not signature-checked (peers are not in lockstep).
"""

import datetime
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from . import host_memory, signature_exchange, signatures
from .host_memory import HostCall
from .work import BCCLWork, combine

BACKEND_NAME = "bccl"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

_RedOp = dist.ReduceOp.RedOpType
_PER_OPERATION_OPTIONS = {
    "allreduce": dist.AllreduceOptions,
    "reduce": dist.ReduceOptions,
    "reduce_scatter": dist.ReduceScatterOptions,
}


def _reduce_kind(op) -> _RedOp:
    if isinstance(op, _RedOp):
        return op
    return op.op


def _numel(tensors: Sequence[torch.Tensor]) -> List[int]:
    return [t.numel() for t in tensors]


class ProcessGroupBCCL(dist.ProcessGroup):
    """A whole process group (not a c10d Backend): torch calls these methods directly."""

    class Options:
        def __init__(self, is_high_priority_stream: bool = False):
            self.is_high_priority_stream = is_high_priority_stream
            self._timeout = DEFAULT_TIMEOUT
            self.global_ranks_in_group: List[int] = []
            self.group_name = ""

    def __init__(self, store: dist.Store, rank: int, size: int, options: "ProcessGroupBCCL.Options"):
        super().__init__(rank, size)
        self.options = options
        self._label = repr(options.group_name or "default")
        timeout = options._timeout
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("bccl/gloo", store), rank, size, timeout)
        self._signatures = signature_exchange.create(store, rank, size, timeout, self._label)
        self._coalesced: Optional[List[BCCLWork]] = None

    # ---- identity ----------------------------------------------------------------------------
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

    def shutdown(self) -> None:
        self._signatures.close()
        self._gloo.shutdown()

    def abort(self) -> None:
        self._signatures.close()
        self._gloo.abort()

    # ---- shared steps --------------------------------------------------------------------------
    def _require_device(self, tensors: Sequence[torch.Tensor], role: str) -> None:
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"bccl: {role} must be tensors, got {type(tensor).__name__}")
            if not host_memory.is_device_tensor(tensor) or tensor.layout != torch.strided:
                raise ValueError(
                    f"bccl: tensors must be {host_memory.DEVICE_TYPE} and dense; the {role} is a "
                    f"{tensor.layout} tensor on device '{tensor.device}'"
                )

    def _single(self, tensors: Sequence[torch.Tensor], role: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise ValueError(f"bccl: expects exactly one {role} tensor per call, got {len(tensors)}")
        self._require_device(tensors, role)
        return tensors[0]

    def _agree(self, signature: List[int], receive_counts: Sequence[int] = ()) -> None:
        if self.size() == 1:
            return
        everyone = self._signatures.exchange(signature)
        signatures.check(everyone, self.rank(), self._label, receive_counts)

    def _finish(self, parts, call: HostCall, outputs: Sequence[torch.Tensor] = ()) -> BCCLWork:
        work = BCCLWork(parts, call.epilogue(), outputs, call.device_tensors)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _gloo_reduce_op(self, kind: _RedOp, dtype: torch.dtype, call: HostCall, result: Callable):
        """The op gloo runs for `kind`, registering the fix-up that completes a composed AVG."""
        if kind == _RedOp.PREMUL_SUM:
            raise ValueError("bccl: ReduceOp.PREMUL_SUM is not supported")
        if kind == _RedOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
            if dtype == torch.bool:
                raise ValueError("bccl: ReduceOp.AVG is not defined for torch.bool")
            size = self.size()
            # Integer average as the device libraries define it: the sum, truncated toward zero.
            call.after(lambda: [t.div_(size, rounding_mode="trunc") for t in result()])
            return dist.ReduceOp.SUM
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

    # ---- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if not isinstance(opts, dist.AllreduceOptions):
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM if op is None else op
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensor = self._single(tensors, "input")
        kind = _reduce_kind(opts.reduceOp)
        self._agree(signatures.make("all_reduce", tensor.dtype, int(kind), numel_in=tensor.numel()))
        call = HostCall()
        view = call.view(tensor)
        gloo_op = self._gloo_reduce_op(kind, tensor.dtype, call, lambda: [view])
        part = self._gloo.allreduce([view], self._options("allreduce", opts, gloo_op))
        return self._finish([part], call, [tensor])

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        self._require_device(tensors, "input")
        kind = _reduce_kind(opts.reduceOp)
        layout = [n for t in tensors for n in (signatures.dtype_code(t.dtype), t.numel())]
        self._agree(
            signatures.make(
                "all_reduce_coalesced", None, int(kind), numel_in=sum(_numel(tensors)),
                shape_digest=signatures.digest(layout),
            )
        )
        call, parts = HostCall(), []
        for tensor in tensors:
            view = call.view(tensor)
            gloo_op = self._gloo_reduce_op(kind, tensor.dtype, call, lambda view=view: [view])
            options = dist.AllreduceOptions()
            options.reduceOp, options.timeout = gloo_op, opts.timeout
            parts.append(self._gloo.allreduce([view], options))
        return self._finish(parts, call, tensors)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        tensor = self._single(tensors, "input")
        kind, root = _reduce_kind(opts.reduceOp), opts.rootRank
        self._agree(signatures.make("reduce", tensor.dtype, int(kind), root, tensor.numel()))
        call = HostCall()
        if self.rank() == root:
            view = call.view(tensor)
            gloo_op = self._gloo_reduce_op(kind, tensor.dtype, call, lambda: [view])
        else:
            # gloo may use a non-root buffer as scratch; the device backends leave it intact.
            view = call.view(tensor, write=False).clone(memory_format=torch.contiguous_format)
            gloo_op = self._gloo_reduce_op(kind, tensor.dtype, HostCall(), lambda: [])
        part = self._gloo.reduce([view], self._options("reduce", opts, gloo_op))
        return self._finish([part], call, [tensor])

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        output = self._single(outputs, "output")
        if len(input_lists) != 1 or len(input_lists[0]) != self.size():
            raise ValueError(f"bccl: reduce_scatter needs one input list of {self.size()} tensors")
        inputs = input_lists[0]
        self._require_device(inputs, "input")
        self._check_chunk(output, inputs[self.rank()], "reduce_scatter", "output", "input list entry")
        kind = _reduce_kind(opts.reduceOp)
        self._agree(
            signatures.make(
                "reduce_scatter", output.dtype, int(kind), shape_digest=signatures.digest(_numel(inputs))
            )
        )
        call = HostCall()
        out_view = call.view(output, read=False)
        in_views = [call.view(t, write=False) for t in inputs]
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
        self._require_device(outputs, "output")
        self._require_device(inputs, "input")
        for output, input in zip(outputs, inputs):
            self._check_sizes(input.numel(), output.numel() * self.size(), operation, input, output)
            self._check_dtypes(output, input, operation)
        kind = _reduce_kind(opts.reduceOp)
        self._agree(
            signatures.make(
                operation, outputs[0].dtype if outputs else None, int(kind),
                numel_in=sum(_numel(inputs)), numel_out=sum(_numel(outputs)),
                shape_digest=signatures.digest(_numel(outputs)),
            )
        )
        call, parts = HostCall(), []
        for output, input in zip(outputs, inputs):
            # gloo wants flat buffers; views of contiguous buffers reshape without copying.
            out_view = call.view(output, read=False).view(-1)
            in_view = call.view(input, write=False).view(-1)
            gloo_op = self._gloo_reduce_op(kind, output.dtype, call, lambda v=out_view: [v])
            parts.append(self._gloo._reduce_scatter_base(out_view, in_view, self._options("reduce_scatter", opts, gloo_op)))
        return self._finish(parts, call, outputs)

    # ---- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        if not isinstance(opts, dist.BroadcastOptions):
            root, opts = opts, dist.BroadcastOptions()
            opts.rootRank = 0 if root is None else root
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensor = self._single(tensors, "tensor")
        self._agree(signatures.make("broadcast", tensor.dtype, root=opts.rootRank, numel_in=tensor.numel()))
        call = HostCall()
        view = call.view(tensor, read=self.rank() == opts.rootRank)
        return self._finish([self._gloo.broadcast([view], opts)], call, [tensor])

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        input = self._single(inputs, "input")
        if len(output_lists) != 1 or len(output_lists[0]) != self.size():
            raise ValueError(f"bccl: all_gather needs one output list of {self.size()} tensors")
        outputs = output_lists[0]
        self._require_device(outputs, "output")
        self._check_chunk(input, outputs[self.rank()], "all_gather", "input", "output list entry")
        for output in outputs:
            self._check_dtypes(output, input, "all_gather")
        sizes = _numel(outputs)
        self._agree(signatures.make("all_gather", input.dtype, shape_digest=signatures.digest(sizes)))
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
        return self._all_gather_tensors([output], [input], opts, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._all_gather_tensors(outputs, inputs, opts, "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_gather_tensors(self, outputs, inputs, opts, operation):
        opts = opts if opts is not None else AllgatherOptions()
        self._require_device(outputs, "output")
        self._require_device(inputs, "input")
        for output, input in zip(outputs, inputs):
            self._check_sizes(output.numel(), input.numel() * self.size(), operation, input, output)
            self._check_dtypes(output, input, operation)
        self._agree(
            signatures.make(
                operation, inputs[0].dtype if inputs else None, numel_in=sum(_numel(inputs)),
                numel_out=sum(_numel(outputs)), shape_digest=signatures.digest(_numel(inputs)),
            )
        )
        call = HostCall()
        parts = [
            self._gloo._allgather_base(
                call.view(output, read=False).view(-1), call.view(input, write=False).view(-1), opts
            )
            for output, input in zip(outputs, inputs)
        ]
        return self._finish(parts, call, outputs)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's layout: output_lists[r][i] receives rank r's inputs[i].
        self._require_device(inputs, "input")
        works = []
        with self._coalescing_paused():
            for i, input in enumerate(inputs):
                works.append(self.allgather([[outputs[i] for outputs in output_lists]], [input], opts))
        work = combine(works)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()
        input = self._single(inputs, "input")
        is_root = self.rank() == opts.rootRank
        outputs = self._root_list(output_lists, is_root, input, "gather", "output")
        self._agree(signatures.make("gather", input.dtype, root=opts.rootRank, numel_in=input.numel()))
        call = HostCall()
        out_views = [[call.view(t, read=False) for t in outputs]] if is_root else []
        part = self._gloo.gather(out_views, [call.view(input, write=False)], opts)
        return self._finish([part], call, outputs)

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()
        output = self._single(outputs, "output")
        is_root = self.rank() == opts.rootRank
        inputs = self._root_list(input_lists, is_root, output, "scatter", "input")
        self._agree(signatures.make("scatter", output.dtype, root=opts.rootRank, numel_out=output.numel()))
        call = HostCall()
        in_views = [[call.view(t, write=False) for t in inputs]] if is_root else []
        part = self._gloo.scatter([call.view(output, read=False)], in_views, opts)
        return self._finish([part], call, [output])

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.AllToAllOptions()
        if len(outputs) != self.size() or len(inputs) != self.size():
            raise ValueError(f"bccl: all_to_all needs {self.size()} input and output tensors")
        self._require_device(outputs, "output")
        self._require_device(inputs, "input")
        for output, input in zip(outputs, inputs):
            self._check_dtypes(output, input, "all_to_all")
        self._agree_all_to_all("all_to_all", inputs[0].dtype, _numel(inputs), _numel(outputs))
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
        self._require_device([output], "output")
        self._require_device([input], "input")
        self._check_dtypes(output, input, "all_to_all_single")
        size = self.size()
        send = self._split_counts(input, input_split_sizes, "input")
        receive = self._split_counts(output, output_split_sizes, "output")
        self._agree_all_to_all("all_to_all_single", input.dtype, send, receive)
        call = HostCall()
        part = self._gloo.alltoall_base(
            call.view(output, read=False), call.view(input, write=False),
            list(output_split_sizes), list(input_split_sizes), opts,
        )
        return self._finish([part], call, [output])

    alltoall_base = all_to_all_single

    def _split_counts(self, tensor, split_sizes, role) -> List[int]:
        """Elements exchanged with each rank, from split sizes along dim 0 (equal split if none)."""
        size = self.size()
        rows = tensor.shape[0] if tensor.dim() else 1
        row = tensor.numel() // rows if rows else 0
        if not split_sizes:
            if rows % size:
                raise ValueError(
                    f"bccl: all_to_all_single {role} dim 0 ({rows}) is not divisible by the group size ({size})"
                )
            return [rows // size * row] * size
        if len(split_sizes) != size or sum(split_sizes) != rows:
            raise ValueError(
                f"bccl: all_to_all_single {role} split sizes {list(split_sizes)} do not cover dim 0 "
                f"({rows}) in {size} parts"
            )
        return [s * row for s in split_sizes]

    def _agree_all_to_all(self, operation, dtype, send: List[int], receive: List[int]) -> None:
        if self.size() == 1:
            return
        if self.size() > signatures.MAX_CROSS_CHECKED_RANKS:
            # Too many ranks to post every send count: check only what all ranks share.
            self._agree(signatures.make(operation, dtype))
            return
        everyone = self._signatures.exchange(signatures.make(operation, dtype, extra=send))
        signatures.check(everyone, self.rank(), self._label, receive)

    # ---- synchronisation and point-to-point -------------------------------------------------
    def barrier(self, opts=None):
        opts = opts if opts is not None else dist.BarrierOptions()
        self._agree(signatures.make("barrier"))
        options = dist.BarrierOptions()
        options.timeout = opts.timeout
        return self._finish([self._gloo.barrier(options)], HostCall())

    def send(self, tensors, dst_rank, tag=0):
        tensor = self._single(tensors, "tensor")
        call = HostCall()
        part = self._gloo.send([call.view(tensor, write=False)], dst_rank, tag)
        return self._finish([part], call)

    def recv(self, tensors, src_rank, tag=0):
        tensor = self._single(tensors, "tensor")
        call = HostCall()
        part = self._gloo.recv([call.view(tensor, read=False)], src_rank, tag)
        return self._finish([part], call, [tensor])

    def recv_anysource(self, tensors, tag=0):
        tensor = self._single(tensors, "tensor")
        call = HostCall()
        part = self._gloo.recv_anysource([call.view(tensor, read=False)], tag)
        return self._finish([part], call, [tensor])

    # ---- coalescing (torch.distributed._coalescing_manager with a device) ------------------
    def _start_coalescing(self, device=None) -> None:
        if self._coalesced is not None:
            raise RuntimeError("bccl: coalescing already started on this group")
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

    # ---- argument checks ------------------------------------------------------------------------
    def _check_sizes(self, actual, expected, operation, input, output) -> None:
        if actual != expected:
            raise ValueError(
                f"bccl: {operation} needs output numel == input numel x group size ({self.size()}) "
                f"(or the reverse for reductions); got input {tuple(input.shape)} and output {tuple(output.shape)}"
            )

    def _root_list(self, lists, is_root, mine, operation, role) -> List[torch.Tensor]:
        """The root's per-rank tensors of gather/scatter, each checked against this rank's tensor."""
        if not is_root:
            return []
        if len(lists) != 1 or len(lists[0]) != self.size():
            raise ValueError(f"bccl: {operation} needs one {role} list of {self.size()} tensors on the root")
        self._require_device(lists[0], role)
        for entry in lists[0]:
            self._check_chunk(mine, entry, operation, "tensor", f"{role} list entry")
        return lists[0]

    def _check_chunk(self, mine, entry, operation, mine_role, entry_role) -> None:
        if mine.numel() != entry.numel():
            raise ValueError(
                f"bccl: {operation} {mine_role} {tuple(mine.shape)} does not match this rank's "
                f"{entry_role} {tuple(entry.shape)}"
            )
        self._check_dtypes(mine, entry, operation)

    @staticmethod
    def _check_dtypes(a, b, operation) -> None:
        if a.dtype != b.dtype:
            raise TypeError(f"bccl: {operation} tensors must share a dtype, got {a.dtype} and {b.dtype}")
