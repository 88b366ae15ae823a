"""What distributed_c10d, DeviceMesh and FSDP ask of a device backend, as ProcessGroupNCCL answers it.

c10d reads a backend's capabilities (`supports_splitting`, `supports_coalescing`, ...), binds it
to a card (`init_process_group(device_id=...)` calls `eager_connect_single_device`), splits
subgroups off it (`split_group`, `perform_nocolor_split`, `comm_split_count`), numbers its
collectives and tears it down (`abort`, `shutdown`). ProcessGroupBCCL is a whole process group
rather than a c10d Backend, so c10d finds all of these on the group itself: this mixin is that
surface, kept apart from the collectives.

The group's transport connects every pair of ranks when the group is constructed (gloo's does):
eager connection has nothing left to connect, and binding only checks the card. A split is, as
ncclCommSplit is, collective over the parent group: every parent rank posts, through the
transport, the ranks of the subgroup it joins (or none), all read all posts (the transport hands
them back), and a split in which the posts do not fit together (a rank in two subgroups, a subgroup naming a rank the parent
does not have) raises the same ValueError on every rank instead of leaving some ranks waiting for
peers that never come. Failures NCCL reports as `DistBackendError` (use after abort, timeouts, lost peers)
are raised with that type here too.
"""

import copy
import datetime
import warnings
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from supa_emu.device_type import DEVICE_TYPE


DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)  # the real backend's default


class Options:
    """ProcessGroupBCCL.Options: what the real backend's Options carry.

    `is_high_priority_stream` asks the real backend to run its kernels on a high-priority stream.
    The emulator runs collectives on gloo's host threads, with no device stream to prioritise,
    so a group created with it set warns that it has no effect here.
    """

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream
        self._timeout = DEFAULT_TIMEOUT
        self.split_from = None  # the group this one was split from (set by the creator)
        self.split_color = 0
        self.global_ranks_in_group: List[int] = []
        self.group_name = ""

    def __deepcopy__(self, memo):
        # split_group deep-copies the parent's options; the parent group itself is shared, not copied.
        fresh = copy.copy(self)
        fresh.global_ranks_in_group = list(self.global_ranks_in_group)
        return fresh


class FixedIdentity:
    """rank() and size() of a Python process group, answered in Python from `_rank` and `_size`.

    c10d's binding of ProcessGroup.rank() and size() lets go of the GIL on every call: with gloo's
    threads waiting for it, that costs microseconds on each collective. A group's rank and size
    never change, so the group answers them itself (C++ callers read the same values from c10d).
    """

    def __init__(self, rank: int, size: int, *args, **kwargs):
        super().__init__(rank, size, *args, **kwargs)
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def closed_error(label: str, rank: int, how: str) -> dist.DistBackendError:
    return dist.DistBackendError(
        f"bccl: the communicator of group {label} was {how} on rank {rank}; "
        "create a new process group to communicate again")


class _ClosedTransport:
    """Stands in for an aborted or shut-down group's transport: any use raises."""

    def __init__(self, error: dist.DistBackendError):
        self._error = error

    def __getattr__(self, name):
        raise self._error


def check_device(device, what: str) -> torch.device:
    """`device` as a supa card index this process can see, or ValueError saying what is accepted."""
    device = torch.device(device)
    if device.type != DEVICE_TYPE or device.index is None:
        raise ValueError(
            f"bccl: {what} must be a {DEVICE_TYPE} device with an index "
            f"(e.g. torch.device('{DEVICE_TYPE}', 0)); got {device}")
    count = torch.accelerator.device_count()
    if device.index >= count:
        raise ValueError(f"bccl: {what} {device} is out of range: {count} {DEVICE_TYPE} cards are visible")
    return device


class C10dBackend:
    """Mixin of ProcessGroupBCCL: the backend attributes torch reads. Expects `kind`, `_transport`,
    `_label`, `_store` and `options` from the group."""

    Options = Options

    supports_splitting = True
    supports_coalescing = True  # _start_coalescing/_end_coalescing batch collectives into one work
    supports_time_estimate = False
    supports_shrinking = False

    def _init_backend_state(self) -> None:
        self._closed: Optional[str] = None
        self._splits = 0  # split_group calls on this group: names each split's store keys
        self._split_count = 0  # splits this group took part in, as NCCL counts them
        self._sequence = 0  # collectives issued on this group
        if self.options.is_high_priority_stream:
            warnings.warn(
                "bccl (emulated): is_high_priority_stream has no effect; collectives run on gloo's "
                "host threads, not on a device stream", UserWarning, stacklevel=3)

    def get_group_store(self) -> dist.Store:
        # c10d registers split groups with this store (its own store slot is only set by a
        # constructor Python subclasses cannot use).
        return self._store

    def supports_tensor_alloc(self, device) -> bool:
        return False  # no communicator memory pool: tensors come from the card's allocator

    # ---- binding and eager connection ---------------------------------------------------------
    def eager_connect_single_device(self, device) -> None:
        """init_process_group(device_id=...): bind this group to the card (gloo connected at construction)."""
        self._require_open()
        self.bound_device_id = check_device(device, "device_id")

    def _is_initialized(self) -> bool:
        return self._closed is None

    # ---- splitting ------------------------------------------------------------------------------
    def comm_split_count(self) -> int:
        return self._split_count

    def perform_nocolor_split(self, device) -> None:
        """This rank's part in a split that gives it no subgroup (new_group without it)."""
        self._require_open()
        check_device(device, "device")
        self.count_split()

    def count_split(self) -> None:
        """One more split of this group (as NCCL counts splits of a communicator)."""
        self._split_count += 1

    def split_group(
        self,
        ranks: Sequence[int],
        timeout: Optional[datetime.timedelta] = None,
        opts: Optional[Options] = None,
        group_name: Optional[str] = None,
        group_desc: Optional[str] = None,
        device_types: Optional[Sequence[torch.device]] = None,
    ):
        """The subgroup of the parent-group `ranks` this rank belongs to (None if not among them).
        Every rank of this group must call it, in the same order as its other splits."""
        self._require_open()
        device_type = self.kind.device_type
        if device_types is not None and all(torch.device(d).type != device_type for d in device_types):
            raise ValueError(f"{self.kind.name}: split_group can only keep the {device_type} backend; "
                             f"got {list(device_types)}")
        if opts is not None and not isinstance(opts, Options):
            raise TypeError("Expected pg_options argument to be of type ProcessGroupBCCL.Options")
        members = sorted(int(r) for r in ranks)
        mine = members if self.rank() in members else None
        self._splits += 1
        self._split_count += 1
        prefix = f"bccl/split/{self._splits}/"
        check_split(self._transport.exchange_split(self._store, prefix, mine), self.size())
        if mine is None:
            return None
        options = copy.deepcopy(opts if opts is not None else self.options)
        if timeout is not None:
            options._timeout = timeout
        parent_globals = self.options.global_ranks_in_group or list(range(self.size()))
        options.global_ranks_in_group = [parent_globals[r] for r in mine]
        options.group_name = group_name or f"{self.group_name}:split:{self._splits}"
        options.split_from, options.split_color = self, split_color(mine)
        store = dist.PrefixStore(f"{prefix}group/{'-'.join(map(str, mine))}/", self._store)
        child = type(self)(store, mine.index(self.rank()), len(mine), options, self.kind)
        if group_desc:
            child._set_group_desc(group_desc)
        return child

    # ---- sequence numbers -----------------------------------------------------------------------
    def _set_sequence_number_for_group(self) -> None:
        # As NCCL: every rank starts at 0 and counts the same collectives, so there is nothing to agree on.
        pass

    def _get_sequence_number_for_group(self) -> int:
        return self._sequence

    # ---- teardown -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._close("shut down")

    _shutdown = shutdown

    def abort(self) -> None:
        self._close("aborted")

    def _close(self, how: str) -> None:
        if self._closed is not None:
            return
        self._closed = how
        transport, error = self._transport, closed_error(self._label, self.rank(), how)
        self._transport = _ClosedTransport(error)
        transport.close(how, error)

    def _require_open(self) -> None:
        if self._closed is not None:
            raise closed_error(self._label, self.rank(), self._closed)


def group_options(backend_options, pg_options=None) -> Options:
    """The options of a new bccl group: the caller's (or the defaults) with what c10d decided."""
    if pg_options is None:
        pg_options = Options()
    elif not isinstance(pg_options, Options):
        raise TypeError("Expected pg_options argument to be of type ProcessGroupBCCL.Options")
    elif pg_options._timeout != backend_options.timeout:
        warnings.warn(f"bccl: pg_options._timeout ({pg_options._timeout}) is replaced by the group's timeout "
                      f"({backend_options.timeout}); pass the timeout to init_process_group/new_group", stacklevel=2)
    pg_options._timeout = backend_options.timeout
    pg_options.global_ranks_in_group = list(backend_options.global_ranks_in_group)
    pg_options.group_name = backend_options.group_id
    parent = _bound_default_group()
    if parent is not None and pg_options.global_ranks_in_group:
        # A subgroup of a bound default group is split from it (the members' side of the split
        # whose other ranks call perform_nocolor_split).
        pg_options.split_from = parent
        pg_options.split_color = split_color(pg_options.global_ranks_in_group)
        parent.count_split()
    return pg_options


def _bound_default_group() -> "C10dBackend | None":
    default = distributed_c10d._world.default_pg
    if isinstance(default, C10dBackend) and default.bound_device_id is not None:
        return default
    return None


def split_color(members: Sequence[int]) -> int:
    # NCCL's split color is a hash of the member list; any value equal across members serves.
    return hash(tuple(members)) & 0x7FFFFFFF


def check_split(posted: List[Optional[List[int]]], size: int) -> None:
    """Raise ValueError unless the subgroups the ranks posted partition (part of) the parent group."""
    for rank, members in enumerate(posted):
        if members is None:
            continue
        outside = [r for r in members if not 0 <= r < size]
        if outside:
            raise ValueError(
                f"bccl: split_group: subgroup {members} names ranks {outside} that the parent group "
                f"(size {size}) does not have; ranks are group ranks in [0, {size - 1}]")
        for member in members:
            if posted[member] != members:
                theirs = "no subgroup" if posted[member] is None else f"subgroup {posted[member]}"
                raise ValueError(
                    f"bccl: split_group: rank {rank} joins subgroup {members} but rank {member} joins "
                    f"{theirs}; the subgroups of one split must not overlap and every rank must pass "
                    "the same split")
