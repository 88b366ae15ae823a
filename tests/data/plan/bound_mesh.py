"""A device-bound world split by a (dp=2, tp=2) DeviceMesh; writes the tp group's size and sum and
the world's split count to OUT.<rank> (JSON).

    bound_mesh.py OUT
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

rank = int(os.environ["RANK"])
dist.init_process_group("bccl", device_id=torch.device("supa", int(os.environ["LOCAL_RANK"])))
mesh = init_device_mesh("supa", (2, 2), mesh_dim_names=("dp", "tp"))  # subgroups by split_group
tp = mesh.get_group("tp")
x = torch.full((3,), float(rank + 1), device="supa")
dist.all_reduce(x, group=tp)
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump({"tp_size": tp.size(), "tp_sum": x.tolist(), "splits": dist.group.WORLD.comm_split_count()}, f)
dist.destroy_process_group()
