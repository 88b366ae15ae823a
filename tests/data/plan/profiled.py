"""Profiles a few bccl collectives; writes the sorted names of the profiler's "bccl:" events to
OUT.<rank> (JSON).

    profiled.py OUT
"""
import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group("bccl")
t = torch.ones(8, device="supa")
out = torch.empty(8 * dist.get_world_size(), device="supa")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.all_gather_into_tensor(out, t)
    dist.reduce_scatter_tensor(t, out)
    dist.barrier()
names = sorted(e.name for e in prof.events() if e.name.startswith("bccl:"))
with open(sys.argv[1] + f".{dist.get_rank()}", "w") as f:
    json.dump(names, f)
dist.destroy_process_group()
