"""Two AdamW steps of an MLP, tensor-parallel over 2 ranks and FSDP2-sharded over 2 (4 ranks)."""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("bccl")
mesh = init_device_mesh("supa", (2, 2), mesh_dim_names=("dp", "tp"))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)).to("supa")
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
model.set_gradient_divide_factor(8.0)  # reduce-scatters with PREMUL_SUM(1/8)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(2):
    model(torch.randn(8, 64, device="supa")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
