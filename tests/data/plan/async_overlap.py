"""An all_reduce of a gradient-sized buffer beside matrix products that do not need it, then a wait
for it, three steps: issued with async_op=True the planner overlaps the two (a step takes about the
longer); with --sync (async_op=False) the products wait for the collective.

    async_overlap.py [--sync]
"""
import os
import sys

import torch
import torch.distributed as dist

import supa_emu.plan

device = torch.device("supa", int(os.environ["LOCAL_RANK"]))
torch.supa.set_device(device)
dist.init_process_group("bccl", device_id=device)
asynchronous = "--sync" not in sys.argv[1:]
gradients = torch.zeros(256 << 20, device=device, dtype=torch.bfloat16)
weight = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
for step in range(3):
    work = dist.all_reduce(gradients, async_op=asynchronous)
    activation = weight
    for layer in range(4):
        activation = activation @ weight
    if work is not None:
        work.wait()
    gradients.add_(activation.sum())
    supa_emu.plan.step_done()
dist.destroy_process_group()
