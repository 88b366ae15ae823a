"""gloo groups in a planned world: the c10d face on host (CPU) tensors, carried by the uniform transport.

Programs create gloo groups beside their device groups (Megatron keeps one per data-parallel
group for checkpointing; object collectives stage on them). A real gloo group would wait for
peer processes that a planned world does not have, so the planner's rank process has c10d build
bccl's own group of kind ("cpu", "gloo", uniform transport) wherever it would build a
ProcessGroupGloo (`install`): its calls are checked, described and reported as a bccl group's,
and answered by the uniform-rank rule (uniform_transport.py). As a real gloo group in a recorded
run, it holds no memory of the card and adds nothing to the card's collectives (rank_record.py
counts only groups on the card).
"""

import datetime

from torch.distributed import distributed_c10d

from supa_emu.distributed import GroupKind, ProcessGroupBCCL
from supa_emu.plan.uniform_transport import UniformTransport

HOST_GROUP = GroupKind("cpu", "gloo", UniformTransport)


def _is_host_group(instance) -> bool:
    return isinstance(instance, ProcessGroupBCCL) and instance.kind == HOST_GROUP


class _GlooName(type):
    """The class c10d finds under the name ProcessGroupGloo in a planned rank: constructing it makes
    a planned gloo group, and c10d's `isinstance(..., ProcessGroupGloo)` checks accept either."""

    def __instancecheck__(cls, instance) -> bool:
        return _is_host_group(instance) or isinstance(instance, cls.real)

    def __getattr__(cls, name):
        return getattr(cls.real, name)  # Options, create_device, ...


def install() -> None:
    """Makes c10d build a planned gloo group wherever it would build a gloo group (in this process
    only: the planner's rank process; monkeypatch, listed in docs/pytorch_patches.md)."""
    real_class = distributed_c10d.ProcessGroupGloo
    if isinstance(real_class, _GlooName):
        return

    class ProcessGroupGloo(metaclass=_GlooName):
        real = real_class

        def __new__(cls, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            options = ProcessGroupBCCL.Options()  # c10d then sets the group's name and global ranks
            options._timeout = timeout
            return ProcessGroupBCCL(store, rank, size, options, HOST_GROUP)

    distributed_c10d.ProcessGroupGloo = ProcessGroupGloo
