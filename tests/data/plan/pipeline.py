"""An MLP cut into pipeline stages of different widths (torch.distributed.pipelining), two Adam steps per schedule.

    pipeline.py DP SCHEDULE [SCHEDULE...]   (gpipe, 1f1b: one stage per rank; interleaved: two per rank)

Each schedule trains its own model in a planner section of its name, one after the other. Stage s
is Linear(width[s], width[s + 1]) + ReLU: each stage holds other parameters and sends activations
of another shape, so the metadata the stages exchange (those shapes) matters. With DP > 1 the
ranks form a (pp, dp) mesh, "pp" outermost as torchtitan's: the stages of a pipeline are ranks DP
apart, and each stage's gradients are averaged over its dp group.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from supa_emu.plan import section

SCHEDULES = {"gpipe": (ScheduleGPipe, 1), "1f1b": (Schedule1F1B, 1), "interleaved": (ScheduleInterleaved1F1B, 2)}
dp = int(sys.argv[1])

torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("bccl")
device = torch.device("supa", torch.supa.current_device())
pp_group = dp_group = None
if dp > 1:
    mesh = init_device_mesh("supa", (dist.get_world_size() // dp, dp), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
rank, world = dist.get_rank(pp_group), dist.get_world_size(pp_group)  # in the pipeline


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def train(name: str) -> None:
    schedule_class, stages_per_rank = SCHEDULES[name]
    stage_count = world * stages_per_rank
    widths = [32 + 16 * (s % 3) for s in range(stage_count)] + [32]
    torch.manual_seed(0)
    stages, parameters = [], []
    for index in range(rank, stage_count, world):  # rank r holds stages r, r + world, ...
        module = torch.nn.Sequential(torch.nn.Linear(widths[index], widths[index + 1]), torch.nn.ReLU()).to(device)
        stages.append(PipelineStage(module, index, stage_count, device, group=pp_group))
        parameters += list(module.parameters())
    schedule = schedule_class(stages if stages_per_rank > 1 else stages[0], n_microbatches=4, loss_fn=loss_fn)
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    for step in range(2):
        inputs = torch.randn(16, widths[0], device=device)
        target = torch.randn(16, widths[-1], device=device)
        losses = []
        if rank == 0:
            schedule.step(inputs)
        elif stages[-1].is_last:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        if dp_group is not None:
            for parameter in parameters:
                dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG, group=dp_group)
        optimizer.step()
        optimizer.zero_grad()
        if losses:
            print(f"{name}: rank {dist.get_rank()} step {step} loss {sum(l.item() for l in losses) / 4:.4f}", flush=True)


for name in sys.argv[2:]:
    with section(name):
        train(name)
dist.destroy_process_group()
