"""Each collective once, on this rank's numbers; writes what each returned to OUT.<rank> (JSON).

    collectives.py OUT
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from supa_emu.plan import section

dist.init_process_group("bccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
local = torch.arange(4, dtype=torch.float32, device="supa") + rank
out = {"rank": rank, "world": world, "backend": dist.get_backend()}
for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("max", dist.ReduceOp.MAX)):
    t = local.clone()
    dist.all_reduce(t, op=op)
    out[name] = t.tolist()
t = local.clone()
dist.all_reduce(t, op=dist.ReduceOp.PREMUL_SUM(0.5))
out["premul_sum"] = t.tolist()
gathered = torch.empty(4 * world, device="supa")
dist.all_gather_into_tensor(gathered, local)
out["all_gather_into_tensor"] = gathered.tolist()
chunk = torch.empty(1, device="supa")
dist.reduce_scatter_tensor(chunk, torch.arange(world, dtype=torch.float32, device="supa"))
out["reduce_scatter_tensor"] = chunk.tolist()
parts = [torch.empty(4, device="supa") for _ in range(world)]
dist.all_gather(parts, local)
out["all_gather"] = [p.tolist() for p in parts]
b = local.clone()
dist.broadcast(b, src=0)
out["broadcast"] = b.tolist()
dist.barrier()
sub = dist.new_group([0, world - 1])
with section("subgroup"):
    t = local.clone()
    dist.all_reduce(t, group=sub)
    out["subgroup_sum"] = t.tolist()
torch.supa.reset_peak_memory_stats()
with section("scratch"):
    scratch = torch.empty(1 << 20, dtype=torch.uint8, device="supa")
    del scratch
out["scratch_peak"] = torch.supa.max_memory_allocated()  # the allocator's own figure
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
