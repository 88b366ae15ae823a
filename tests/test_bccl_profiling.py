"""bccl's collectives appear in profiler traces as c10d's backends make them appear: one
asynchronous event per collective, named `<backend>:<operation>` (DDP's profiling and torch's
tests look for `bccl:all_reduce`, `bccl:broadcast`), and none when nothing records.

One fresh process with a group of one rank; DDP's use of the events runs in torch's own
test_ddp_profiling_torch_profiler (test_torch_distributed.py).
"""

import pytest
from harness import shared_case

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

_SCENARIO = """
    import json
    import torch
    import torch.distributed as dist

    dist.init_process_group("bccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    t = torch.ones(1000, device="supa:0")
    dist.all_reduce(t)  # before profiling: must not appear
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            dist.all_reduce(t)
        dist.broadcast(t, 0)
        out = torch.empty(1000, device="supa:0")
        dist.all_gather_into_tensor(out, t)
        dist.barrier()
    dist.destroy_process_group()
    events = [(e.name, e.count, bool(e.is_async)) for e in prof.events() if e.name.startswith("bccl:")]
    print("RESULT " + json.dumps(events))
"""


_RUN = shared_case(f"{__name__}: the scenario", _SCENARIO, env={"SUPA_EMULATE": "1"})


@pytest.fixture(scope="module")
def events():
    return _RUN.scenario_result()


def test_one_event_per_collective_while_recording(events):
    names = [name for name, _, _ in events]
    assert names.count("bccl:all_reduce") == 3
    assert names.count("bccl:broadcast") == 1
    assert names.count("bccl:_allgather_base") == 1
    assert names.count("bccl:barrier") == 1


def test_events_are_asynchronous(events):
    assert events and all(is_async for _, _, is_async in events), events
