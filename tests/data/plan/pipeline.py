"""An MLP cut into pipeline stages of different widths (torch.distributed.pipelining), two Adam steps.

    pipeline.py SCHEDULE      (gpipe, 1f1b: one stage per rank; interleaved: two stages per rank)

Stage s is Linear(width[s], width[s + 1]) + ReLU: each stage holds other parameters and sends
activations of another shape, so the stages' metadata (the shapes they exchange) matters.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved": (ScheduleInterleaved1F1B, 2)}
schedule_class, stages_per_rank = SCHEDULES[sys.argv[1]]

torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("bccl")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("supa", torch.supa.current_device())
stage_count = world * stages_per_rank
widths = [32 + 16 * (s % 3) for s in range(stage_count)] + [32]

torch.manual_seed(0)
stages, parameters = [], []
for index in range(rank, stage_count, world):  # rank r holds stages r, r + world, ...
    module = torch.nn.Sequential(torch.nn.Linear(widths[index], widths[index + 1]), torch.nn.ReLU()).to(device)
    stages.append(PipelineStage(module, index, stage_count, device))
    parameters += list(module.parameters())


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


schedule = schedule_class(stages if stages_per_rank > 1 else stages[0], n_microbatches=4, loss_fn=loss_fn)
optimizer = torch.optim.Adam(parameters, lr=1e-3)
for step in range(2):
    inputs = torch.randn(16, widths[0], device=device)
    target = torch.randn(16, widths[-1], device=device)
    losses = []
    if rank == 0 and rank == world - 1:
        schedule.step(inputs, target=target, losses=losses)
    elif rank == 0:
        schedule.step(inputs)
    elif stages[-1].is_last:
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    optimizer.step()
    optimizer.zero_grad()
    if losses:
        print(f"rank {rank} step {step} loss {sum(l.item() for l in losses) / len(losses):.4f}", flush=True)
dist.destroy_process_group()
