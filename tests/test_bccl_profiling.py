"""bccl's collectives appear in profiler traces as c10d's backends make them appear: one
asynchronous event per collective, named `<backend>:<operation>` (DDP's profiling and torch's
tests look for `bccl:all_reduce`, `bccl:broadcast`), and none when nothing records.

The body runs in a rank of a group of one (harness.distributed_test); DDP's use of the events runs
in torch's own test_ddp_profiling_torch_profiler (test_torch_distributed.py).
"""

import pytest
from ranks import distributed_test
import torch
import torch.distributed as dist

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")


def _profiled_collectives():
    """The bccl events of a profile of 3 all_reduce, a broadcast, an all_gather_into_tensor and a
    barrier, after an all_reduce before profiling (which must not appear)."""
    t = torch.ones(1000, device="supa")
    dist.all_reduce(t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather_into_tensor(torch.empty(1000, device="supa"), t)
        dist.barrier()
    return [event for event in prof.events() if event.name.startswith("bccl:")]


@distributed_test(world=1)
def test_one_event_per_collective_while_recording(rank, world):
    names = [event.name for event in _profiled_collectives()]
    assert names.count("bccl:all_reduce") == 3, names
    assert names.count("bccl:broadcast") == 1, names
    assert names.count("bccl:_allgather_base") == 1, names
    assert names.count("bccl:barrier") == 1, names


@distributed_test(world=1)
def test_events_are_asynchronous(rank, world):
    events = _profiled_collectives()
    assert events and all(event.is_async for event in events), [(event.name, event.is_async) for event in events]
