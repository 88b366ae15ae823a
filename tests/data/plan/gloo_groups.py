"""A gloo group beside the world (as Megatron keeps one beside each device group): its collectives on
this rank's numbers; writes what each returned to OUT.<rank> (JSON).

    gloo_groups.py OUT WORLD_BACKEND
"""
import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group(sys.argv[2])
rank, world = dist.get_rank(), dist.get_world_size()
cpu = dist.new_group(backend="gloo")
out = {"world_backend": dist.get_backend(), "cpu_backend": dist.get_backend(cpu)}
t = torch.arange(4.0) + rank
dist.all_reduce(t, group=cpu)
out["sum"] = t.tolist()
t = torch.arange(4.0) + rank
dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu)
out["max"] = t.tolist()
parts = [torch.empty(2) for _ in range(world)]
dist.all_gather(parts, torch.full((2,), float(rank)), group=cpu)
out["all_gather"] = [p.tolist() for p in parts]
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank}, group=cpu)
out["objects"] = objects
chosen = [f"from rank {rank}"]
dist.broadcast_object_list(chosen, src=0, group=cpu)
out["broadcast_object"] = chosen[0]
dist.barrier(group=cpu)
try:  # checked as a gloo group's call: its tensors live on the host
    dist.all_reduce(torch.ones(2, device="supa"), group=cpu)
except ValueError as error:
    out["supa_tensor"] = str(error)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    dist.all_reduce(torch.ones(2), group=cpu)
out["profiled"] = sorted(e.name for e in prof.events() if e.name.startswith("gloo:"))
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
