"""ProcessGroupBCCL: the emulator's c10d face, one method per c10d entry point, each handing a record to a transport.

An entry point checks its operands and describes the call in one record (collective.py: the op,
its tensors with their access, reduce op, root), hands it to the group's transport, which carries
it (see transport.py), and issues the work it gets back: the record names the call to c10d's
sequence numbering, the coalescing manager, the profiler, the stream and memory checkers and the
watchers (the planner's recorder). What c10d reads of a backend besides the collectives (device
binding, splitting, teardown) is in c10d_backend.py.

A group is of one kind (`GroupKind`): the device type of its tensors, its backend name and its
transport. Every bccl group is ("supa", "bccl", the transport installed in this process): gloo's
between real ranks, registered where the package is assembled (supa_emu.distributed.register),
or the planner's uniform transport in a planned rank, which also builds its gloo groups as
("cpu", "gloo", uniform transport) (supa_emu.plan.gloo_groups). This module imports no transport.
"""

from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from supa_emu.device_type import DEVICE_TYPE
from supa_emu.supa import _sanitizer_switch as _sanitizer

from . import collective, profiling
from .c10d_backend import C10dBackend, FixedIdentity
from .collective import POINT_TO_POINT, Collective
from .transport import Factory
from .work import BCCLWork, combine

BACKEND_NAME = "bccl"


class GroupKind(NamedTuple):
    """What a group is: where its tensors live, the name c10d and its errors give it, what carries its calls."""

    device_type: str
    name: str
    transport: Factory


class Watcher:
    """What sees the bccl groups c10d creates in this process and every collective any group of
    this class issues, bccl's or a planned rank's gloo groups' (`watch`)."""

    def group_created(self, rank: int) -> None:
        """A bccl group is about to be created by c10d, with this process as `rank`."""

    def collective_issued(self, group: "ProcessGroupBCCL", call: Collective, work: BCCLWork) -> None:
        """`group`'s transport started `call` (`group.kind` says which kind of group it is); `work` is
        the handle the caller gets (`work.when_waited` tells where the program waits for it)."""


_transport: Optional[Factory] = None
_watchers: List[Watcher] = []


def install_transport(factory: Factory) -> None:
    """bccl groups created from now on in this process carry their calls with `factory`'s transport."""
    global _transport
    _transport = factory


def installed_transport() -> Optional[Factory]:
    return _transport


def bccl() -> GroupKind:
    """The kind of a bccl group created now: on supa tensors, with the transport installed."""
    if _transport is None:
        raise RuntimeError("bccl: no transport is installed; supa_emu.distributed.register() installs gloo's")
    return GroupKind(DEVICE_TYPE, BACKEND_NAME, _transport)


def watch(watcher: Watcher) -> None:
    """Show `watcher` the groups created and the collectives issued from now on in this process."""
    _watchers.append(watcher)


def announce_group(rank: int) -> None:
    """Tell the watchers that c10d is about to create a bccl group with this process as `rank`."""
    for watcher in _watchers:
        watcher.group_created(rank)


class ProcessGroupBCCL(FixedIdentity, C10dBackend, dist.ProcessGroup):
    """A whole process group (not a c10d Backend) of kind `kind` (a bccl group unless said
    otherwise): torch calls these methods directly (the backend attributes c10d reads come from
    C10dBackend)."""

    def __init__(self, store: dist.Store, rank: int, size: int, options: "ProcessGroupBCCL.Options",
                 kind: Optional[GroupKind] = None):
        super().__init__(rank, size)
        self.kind = kind if kind is not None else bccl()
        self.options = options
        self._store = store
        self._label = repr(options.group_name or "default")
        self._transport = self.kind.transport(store, rank, size, options, self._label)
        self._coalesced: Optional[List[BCCLWork]] = None
        self._init_backend_state()

    # ---- identity ----------------------------------------------------------------------------
    # c10d keeps a group's name in its c10d Backends, which this whole-group plugin has none of;
    # without these, `group.group_name` (read by DeviceMesh and FSDP) raises "name not set".
    @property
    def group_name(self) -> str:
        return self.options.group_name

    def _set_group_name(self, name: str) -> None:
        self.options.group_name = name

    def _get_backend(self, device: torch.device):
        # This whole group is the backend of its tensors' device (c10d's lookup table is empty).
        if torch.device(device).type == self.kind.device_type:
            return self
        return super()._get_backend(device)

    def getBackendName(self) -> str:
        return self.kind.name

    def name(self) -> str:
        return self.kind.name

    def _get_backend_name(self) -> str:
        return self.kind.name

    @property
    def _device_types(self) -> List[torch.device]:
        # Object collectives (all_gather_object, broadcast_object_list) stage on this device.
        return [torch.device(self.kind.device_type)]

    # ---- issuing -----------------------------------------------------------------------------
    def _issue(self, call: Collective, work: BCCLWork) -> BCCLWork:
        """`work`, which the transport started for `call`, counted and reported as that call."""
        if self._coalesced is not None:
            self._coalesced.append(work)  # the block counted once, at its start
        elif call.op not in POINT_TO_POINT:
            self._sequence += 1
        profiling.record(self.kind.name, call, work.parts)
        sanitizer = _sanitizer.active()
        if sanitizer is not None:
            sanitizer.collective_issued(work, self._label, call.accesses(), call.operation.method)
        for watcher in _watchers:
            watcher.collective_issued(self, call, work)
        return work

    # ---- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        call = collective.all_reduce(self.kind, tensors, opts)
        return self._issue(call, self._transport.all_reduce(call))

    def allreduce_coalesced(self, tensors, opts=None):
        call = collective.all_reduce_coalesced(self.kind, tensors, opts)
        return self._issue(call, self._transport.all_reduce_coalesced(call))

    def reduce(self, tensors, opts=None):
        call = collective.reduce(self.kind, tensors, opts, self.rank())
        return self._issue(call, self._transport.reduce(call))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        call = collective.reduce_scatter(self.kind, outputs, input_lists, opts, self.size(), self.rank())
        return self._issue(call, self._transport.reduce_scatter(call))

    def reduce_scatter_single(self, output, input, opts=None):
        call = collective.reduce_scatter_tensor(self.kind, [output], [input], opts, self._size)
        return self._issue(call, self._transport.reduce_scatter_tensor(call))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        call = collective.reduce_scatter_tensor(self.kind, outputs, inputs, opts, self.size(),
                                                "reduce_scatter_tensor_coalesced")
        return self._issue(call, self._transport.reduce_scatter_tensor(call))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        call = collective.broadcast(self.kind, tensors, opts, self.rank())
        return self._issue(call, self._transport.broadcast(call))

    def allgather(self, output_lists, inputs, opts=None):
        call = collective.all_gather(self.kind, output_lists, inputs, opts, self.size(), self.rank())
        return self._issue(call, self._transport.all_gather(call))

    def all_gather_single(self, output, input, opts=None):
        call = collective.all_gather_into_tensor(self.kind, [output], [input], opts, self._size)
        return self._issue(call, self._transport.all_gather_into_tensor(call))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        call = collective.all_gather_into_tensor(self.kind, outputs, inputs, opts, self.size(),
                                                 "all_gather_into_tensor_coalesced")
        return self._issue(call, self._transport.all_gather_into_tensor(call))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        # torch's layout: output_lists[r][i] receives rank r's inputs[i]. One all_gather per input.
        collective.require_device(self.kind, inputs, "input")
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
        call = collective.gather(self.kind, output_lists, inputs, opts, self.size(), self.rank())
        return self._issue(call, self._transport.gather(call))

    def scatter(self, outputs, input_lists, opts=None):
        call = collective.scatter(self.kind, outputs, input_lists, opts, self.size(), self.rank())
        return self._issue(call, self._transport.scatter(call))

    def alltoall(self, outputs, inputs, opts=None):
        call = collective.all_to_all(self.kind, outputs, inputs, opts, self.size())
        return self._issue(call, self._transport.all_to_all(call))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        call = collective.all_to_all_single(self.kind, output, input, output_split_sizes, input_split_sizes, opts,
                                            self.size())
        return self._issue(call, self._transport.all_to_all_single(call))

    alltoall_base = all_to_all_single

    # ---- synchronisation and point-to-point -------------------------------------------------
    def barrier(self, opts=None):
        call = collective.barrier(self.kind, opts)
        return self._issue(call, self._transport.barrier(call))

    def send(self, tensors, dst_rank, tag=0):
        call = collective.send(self.kind, tensors, dst_rank, tag)
        return self._issue(call, self._transport.send(call))

    def recv(self, tensors, src_rank, tag=0):
        call = collective.recv(self.kind, tensors, src_rank, tag)
        return self._issue(call, self._transport.recv(call))

    def recv_anysource(self, tensors, tag=0):
        call = collective.recv(self.kind, tensors, None, tag)
        return self._issue(call, self._transport.recv(call))

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
