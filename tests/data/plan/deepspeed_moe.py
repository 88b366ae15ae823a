"""DeepSpeed MoE layers (deepspeed.moe.layer.MoE), experts over all ranks (ep_size = the world), two Adam steps each.

    deepspeed_moe.py ROUTE   (router: the gate's own choice; balanced; worst:R: every rank routes to rank R)

Sections, one MoE layer each: `top1` and `top2` (drop_tokens=False: the capacity is the most
tokens any expert received on any rank, all_reduced with MAX over the expert-parallel group and
read with `int()`, so the buffers the all_to_alls move follow the routing) and `top1_drop`
(drop_tokens=True: a fixed capacity, the same buffers whatever the routing). The gate's weight is
fixed to read the first E features of each token as its logits, so ROUTE forces this real job's
routing through its input: `balanced` gives token t's i-th choice to expert (t * K + i) mod E,
`worst:R` every token's choices to rank R's experts. The planner does not need it:
`--moe-routing` makes the same choice at the gate.
"""
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE

from supa_emu.plan import section

TOKENS, DIM, HIDDEN, EXPERTS = 256, 64, 128, 8
route = sys.argv[1]

torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
deepspeed.init_distributed(dist_backend="bccl")
device = torch.device("supa", torch.supa.current_device())
ep = dist.get_world_size()


def tokens(top_k: int) -> torch.Tensor:
    """This step's tokens (host): random, and under a forced ROUTE with the chosen experts' logits in front."""
    x = torch.randn(TOKENS, DIM)
    if route != "router":
        x[:, :EXPERTS] = 0
        if route == "balanced":
            experts = (torch.arange(TOKENS * top_k) % EXPERTS).view(TOKENS, top_k)
        else:
            first = int(route.split(":")[1]) * (EXPERTS // ep)
            experts = ((first + torch.arange(top_k)) % EXPERTS).expand(TOKENS, top_k)
        preference = 50.0 * torch.arange(top_k, 0, -1, dtype=torch.float32)  # the first choice highest
        x[:, :EXPERTS].scatter_(1, experts, preference.expand(TOKENS, top_k))
    return x


def train(name: str, top_k: int, drop_tokens: bool) -> None:
    torch.manual_seed(dist.get_rank())
    expert = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, DIM))
    moe = MoE(DIM, expert, num_experts=EXPERTS, ep_size=ep, k=top_k, drop_tokens=drop_tokens,
              top2_2nd_expert_sampling=False)
    gate = moe.deepspeed_moe.gate.wg.weight
    with torch.no_grad():  # logits = the first EXPERTS features; the gate is not trained
        gate.zero_()
        gate[:, :EXPERTS] = torch.eye(EXPERTS)
    gate.requires_grad_(False)
    moe.set_deepspeed_parallelism()
    moe.to(device)
    optimizer = torch.optim.Adam([p for p in moe.parameters() if p.requires_grad], lr=1e-3)
    for step in range(2):
        output, aux_loss, _ = moe(tokens(top_k).to(device))
        loss = output.pow(2).mean() + 0.01 * aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"{name}: rank {dist.get_rank()} route {route} loss {loss.item():.4f}", flush=True)


for name, top_k, drop_tokens in [("top1", 1, False), ("top2", 2, False), ("top1_drop", 1, True)]:
    with section(name):
        train(name, top_k, drop_tokens)
dist.destroy_process_group()
