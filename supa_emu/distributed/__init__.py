"""The `bccl` process-group backend: torch.distributed on emulated SUPA devices, carried by gloo.

Route. torch 2.13 lets a backend plugin return either a c10d `Backend` or a whole
`torch.distributed.ProcessGroup`; c10d's `Backend` cannot be subclassed from Python (it has no
Python constructor), so bccl is a `ProcessGroup` subclass (`ProcessGroupBCCL`). init_process_group
and new_group use the object it returns as the group itself, and every torch.distributed function
calls its methods directly: all_reduce -> `allreduce`, all_gather_into_tensor ->
`all_gather_single`, reduce_scatter_tensor -> `reduce_scatter_single`, the coalescing manager ->
`*_coalesced` plus `_start_coalescing`/`_end_coalescing`, and so on. The C++ spellings
(`_allgather_base`, `alltoall_base`, ...) are aliases, so C++ callers that go through the
process-group trampoline land in the same code. Each group checks a call, describes it in one
record and hands that to its transport (process_group.py, collective.py, transport.py); between
real ranks the transport is a private gloo group working on CPU views that alias the device
tensors' host memory: no copy on the way in or out (the gloo/ package).

This is where the package is assembled. `register()` installs the backend under the name "bccl"
for the "supa" device with the extended plugin API, makes gloo's the transport of bccl groups
(unless one was installed already), and makes 10 minutes (the real backend's default) the timeout
a bccl group gets when init_process_group/new_group are not given one. `install_transport()` and
`watch()` are how the planner (supa_emu/plan), which this package never imports, plugs its world
and its recorder in.
"""

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d

from supa_emu import core_share
from supa_emu.device_type import DEVICE_TYPE

from . import c10d_backend, compile_boundary, process_group
from .c10d_backend import DEFAULT_TIMEOUT
from .gloo import CollectiveMismatchError, GlooTransport, GlooWork
from .process_group import BACKEND_NAME, GroupKind, ProcessGroupBCCL, Watcher, install_transport, watch
from .work import BCCLWork

__all__ = [
    "BACKEND_NAME",
    "BCCLWork",
    "CollectiveMismatchError",
    "DEFAULT_TIMEOUT",
    "GroupKind",
    "ProcessGroupBCCL",
    "Watcher",
    "install_transport",
    "is_registered",
    "register",
    "watch",
]


def _create_process_group(backend_options, pg_options=None) -> ProcessGroupBCCL:
    process_group.announce_group(backend_options.group_rank)
    core_share.at_first_group(backend_options.group_size)
    return ProcessGroupBCCL(
        backend_options.store, backend_options.group_rank, backend_options.group_size,
        c10d_backend.group_options(backend_options, pg_options)
    )


def _default_timeout_for(original):
    def default_timeout(backend) -> datetime.timedelta:
        if backend == BACKEND_NAME:
            return DEFAULT_TIMEOUT
        return original(backend)

    default_timeout._bccl_wrapped = original
    return default_timeout


def is_registered() -> bool:
    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
    return plugin is not None and plugin.creator_fn is _create_process_group


def register() -> None:
    """Make `init_process_group("bccl")` available; calling it again changes nothing."""
    compile_boundary.run_eagerly(ProcessGroupBCCL, ProcessGroupBCCL.Options, BCCLWork, GlooWork)
    if process_group.installed_transport() is None:
        install_transport(GlooTransport)
    if not is_registered():
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=[DEVICE_TYPE])
    if not hasattr(distributed_c10d._get_default_timeout, "_bccl_wrapped"):
        distributed_c10d._get_default_timeout = _default_timeout_for(distributed_c10d._get_default_timeout)
