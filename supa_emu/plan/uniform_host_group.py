"""gloo groups in a planned world: collectives on host (CPU) tensors follow the uniform-rank rule.

Programs create gloo groups beside their device groups (Megatron keeps one per data-parallel
group for checkpointing; object collectives stage on them). A real gloo group would wait for
peer processes that a planned world does not have, so the planner's rank process builds this
group wherever c10d would build a ProcessGroupGloo (`install`). It answers as a planned bccl
group does (uniform_transport.py): a reduction is that of N copies of this rank's tensor, gathers
replicate it, a reduce_scatter gives this rank's chunk reduced N times, a small broadcast carries
the root's value when rank 0 was played first. Its limits: it holds no memory of the card and, as a real gloo group
in a recorded run, it records no collectives; where an answer depends on values only other ranks
hold (a scatter's or recv's data, uneven all_to_all splits) the call is flagged for the report.
"""

import datetime
from typing import List

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from supa_emu.distributed.c10d_backend import FixedIdentity, Options
from supa_emu.distributed.collective import check_reduction, premultiplied, reduce_kind
from supa_emu.plan import call_record, uniform_transport, world


def _done(result=None) -> dist.Work:
    future = torch.futures.Future()
    future.set_result(result if result is not None else [])
    return _create_work_from_future(future)


class UniformHostGroup(FixedIdentity, dist.ProcessGroup):
    """The planned world's stand-in for a gloo group (a whole process group, as bccl's is)."""

    def __init__(self, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self.options = Options()  # what c10d sets and reads: timeout, group name, global ranks
        self.options._timeout = timeout
        self._sequence = 0

    # ---- what c10d asks of a backend ---------------------------------------------------------
    @property
    def group_name(self) -> str:
        return self.options.group_name

    def _set_group_name(self, name: str) -> None:
        self.options.group_name = name

    def getBackendName(self) -> str:
        return "gloo"

    name = _get_backend_name = getBackendName

    @property
    def _device_types(self) -> List[torch.device]:
        return [torch.device("cpu")]

    def _get_backend(self, device):
        return self

    def _set_sequence_number_for_group(self) -> None:
        pass

    def _get_sequence_number_for_group(self) -> int:
        return self._sequence

    def _reduce(self, tensor: torch.Tensor, op) -> None:
        check_reduction(op, tensor.dtype)
        uniform_transport.reduce_uniform(premultiplied(tensor, op, in_place=True), reduce_kind(op), self.size())

    # ---- collectives -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if isinstance(opts, dist.AllreduceOptions) else (opts or dist.ReduceOp.SUM)
        for tensor in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            self._reduce(tensor, op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts.reduceOp if opts is not None else None)

    def reduce(self, tensors, opts=None):
        if self.rank() == opts.rootRank:
            self._reduce(tensors[0], opts.reduceOp)
        return _done(tensors)

    def broadcast(self, tensors, opts=None):
        for tensor in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            value = world.root_value(self.group_name, tensor, self.rank() == opts.rootRank)
            if value is not None:
                tensor.copy_(value.reshape(tensor.shape))
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts=None):
        for outputs, input in zip(output_lists, inputs):
            for output in outputs:
                if output.numel() == input.numel():
                    output.copy_(input.reshape(output.shape))
                else:
                    call_record.flag("all_gather with unequal sizes: the other ranks' slots keep their contents")
        return _done(output_lists)

    def _allgather_base(self, output, input, opts=None):
        output.view(self.size(), -1).copy_(input.reshape(1, -1))
        return _done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input)
        return _done(outputs)

    def gather(self, output_lists, inputs, opts=None):
        if self.rank() == opts.rootRank:
            for output in output_lists[0]:
                output.copy_(inputs[0].reshape(output.shape))
        return _done(output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        if self.rank() == opts.rootRank:
            outputs[0].copy_(input_lists[0][self.rank()].reshape(outputs[0].shape))
        else:
            call_record.flag("scatter: a non-root rank's output is the root's data; it keeps its contents")
        return _done(outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        outputs[0].copy_(input_lists[0][self.rank()].reshape(outputs[0].shape))
        self._reduce(outputs[0], opts.reduceOp)
        return _done(outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        chunk = output.numel()
        output.copy_(input.reshape(-1)[self.rank() * chunk:(self.rank() + 1) * chunk].reshape(output.shape))
        self._reduce(output, opts.reduceOp)
        return _done([output])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        rows = input.shape[0] if input.dim() else 1
        send = list(input_split_sizes) or [rows // self.size()] * self.size()
        start = sum(send[:self.rank()])
        mine = input.reshape(rows, -1)[start:start + send[self.rank()]]
        receive = list(output_split_sizes) or [output.shape[0] // self.size()] * self.size()
        uniform_transport.receive_own_chunk(list(output.reshape(output.shape[0], -1).split(receive)), mine,
                                        "all_to_all_single")
        return _done([output])

    def alltoall(self, outputs, inputs, opts=None):
        uniform_transport.receive_own_chunk(outputs, inputs[self.rank()], "all_to_all")
        return _done(outputs)

    def barrier(self, opts=None):
        return _done()

    def send(self, tensors, dst_rank, tag=0):
        return _done()

    def recv(self, tensors, src_rank, tag=0):
        call_record.flag("recv: the data another rank sends is not known; the buffer keeps its contents")
        return _done(tensors)

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, -1, tag)


class _GlooName(type):
    """The class c10d finds under the name ProcessGroupGloo in a planned rank: constructing it makes
    a UniformHostGroup, and c10d's `isinstance(..., ProcessGroupGloo)` checks accept either."""

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, (UniformHostGroup, cls.real))

    def __getattr__(cls, name):
        return getattr(cls.real, name)  # Options, create_device, ...


def install() -> None:
    """Makes c10d build a UniformHostGroup wherever it would build a gloo group (in this process
    only: the planner's rank process; monkeypatch, listed in docs/pytorch_patches.md)."""
    from torch.distributed import distributed_c10d

    real_class = distributed_c10d.ProcessGroupGloo
    if isinstance(real_class, _GlooName):
        return

    class ProcessGroupGloo(metaclass=_GlooName):
        real = real_class

        def __new__(cls, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            world.admit(rank, size)
            return UniformHostGroup(rank, size, timeout)

    distributed_c10d.ProcessGroupGloo = ProcessGroupGloo
