"""A two-stage toy pipeline, three steps: stage 0 (rank 0) runs a long chain of matrix products and sends
its activation to stage 1 (rank 1), which runs a short chain and sends a gradient back; stage 0 waits
for it and runs a short chain. On cards stage 1 idles until stage 0's forward arrives (the bubble).
The messages are 2 MiB of bf16, more than the planner carries, so no rank waits for their contents.

    pipeline_bubble.py [--crossed]
        --crossed: each rank waits for a receive before it sends, from a side stream, what its peer
        waits for: a card runs it (the side stream does not wait), a model that held the whole
        rank at the wait would not (the planner times one of them without its peer)
"""
import os
import sys

import torch
import torch.distributed as dist

import supa_emu.plan

LONG, SHORT, SIZE = 24, 2, 1024

device = torch.device("supa", int(os.environ["LOCAL_RANK"]))
torch.supa.set_device(device)
dist.init_process_group("bccl", device_id=device)
rank, peer = dist.get_rank(), 1 - dist.get_rank()
weight = torch.randn(SIZE, SIZE, device=device, dtype=torch.bfloat16) / SIZE ** 0.5
message = torch.zeros(SIZE, SIZE, device=device, dtype=torch.bfloat16)
side = torch.supa.Stream()


def chain(x, n):
    for _ in range(n):
        x = x @ weight
    return x


for step in range(3):
    if "--crossed" in sys.argv[1:]:
        dist.irecv(message, src=peer).wait()
        with torch.supa.stream(side):
            dist.isend(chain(weight, SHORT), dst=peer).wait()
        chain(message, SHORT)
    elif rank == 0:
        dist.isend(chain(weight, LONG), dst=1).wait()  # the forward
        dist.irecv(message, src=1).wait()  # the gradient
        chain(message, SHORT)
    else:
        dist.irecv(message, src=0).wait()
        dist.isend(chain(message, SHORT), dst=0).wait()
    supa_emu.plan.step_done()
dist.destroy_process_group()
