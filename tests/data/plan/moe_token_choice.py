"""A token-choice MoE layer in torchtitan's style, experts split over all ranks (EP = the world), two Adam steps.

    moe_token_choice.py ROUTE   (router: the router's own choice; balanced; worst:R: every rank routes to rank R)

Each rank routes its tokens to the top-K of E experts (`TokenChoiceTopKRouter`: a gate, softmax,
torch.topk), counts the tokens per expert, exchanges the counts with an all_to_all_single, reads
the splits with `.tolist()` and sends the tokens with an uneven all_to_all_single; each local
expert multiplies the rows it received, and the results go back the same way. The memory a rank
holds and the sizes it sends follow from the routing. ROUTE forces the router of this real job:
`balanced` routes token t's i-th choice to expert (t * K + i) mod E, `worst:R` every token's K
choices to rank R's experts. The planner does not need it: `--moe-routing` makes the same choice.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from supa_emu.plan import section

TOKENS, DIM, HIDDEN, EXPERTS, TOP_K = 256, 64, 128, 8, 2
route = sys.argv[1]

torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("bccl")
device = torch.device("supa", torch.supa.current_device())
ep_group, ep = dist.group.WORLD, dist.get_world_size()
local = EXPERTS // ep


def forced_experts(tokens: int) -> torch.Tensor:
    """The experts this real job's ROUTE chooses for each token (host, [tokens, TOP_K])."""
    if route == "balanced":
        return (torch.arange(tokens * TOP_K) % EXPERTS).view(tokens, TOP_K)
    target = int(route.split(":")[1])
    return ((target * local + torch.arange(TOP_K)) % EXPERTS).expand(tokens, TOP_K)


class TokenChoiceTopKRouter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k = EXPERTS, TOP_K
        self.gate = torch.nn.Linear(DIM, EXPERTS, bias=False)

    def forward(self, x):
        scores = torch.softmax(self.gate(x), dim=-1)
        _, chosen = torch.topk(scores, k=self.top_k, dim=-1)
        if route != "router":
            chosen.copy_(forced_experts(chosen.shape[0]))
        return scores.gather(-1, chosen), chosen


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ep_group = ep_group
        self.router = TokenChoiceTopKRouter()
        self.w1 = torch.nn.Parameter(torch.randn(local, HIDDEN, DIM) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(local, DIM, HIDDEN) * 0.1)

    def forward(self, x):
        weights, chosen = self.router(x)
        counts = torch.zeros(x.shape[0], EXPERTS, dtype=torch.bool, device=x.device).scatter_(1, chosen, True).sum(0)
        order = torch.argsort(chosen.view(-1), stable=True)
        routed = x[order // TOP_K]
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.ep_group)
        input_splits = counts.view(ep, local).sum(1).tolist()
        output_splits = received_counts.view(ep, local).sum(1).tolist()
        received = all_to_all_single_autograd(routed, output_splits, input_splits, self.ep_group)
        # Rows arrive rank-major ((rank 0: expert 0, 1, ...), (rank 1: ...)); each expert takes its own.
        chunks = list(received.split(received_counts.tolist()))
        for expert in range(local):
            mine = [chunks[r * local + expert] for r in range(ep)]
            hidden = torch.nn.functional.silu(torch.cat(mine) @ self.w1[expert].t()) @ self.w2[expert].t()
            for r, out in zip(range(ep), hidden.split([len(m) for m in mine])):
                chunks[r * local + expert] = out
        back = all_to_all_single_autograd(torch.cat(chunks), input_splits, output_splits, self.ep_group)
        combined = back * weights.view(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, order // TOP_K, combined)


with section("moe"):
    torch.manual_seed(dist.get_rank())
    moe = MoE().to(device)
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-3)
    for step in range(2):
        x = torch.randn(TOKENS, DIM, device=device)
        loss = moe(x).pow(2).mean()
        loss.backward()
        dist.all_reduce(moe.router.gate.weight.grad, op=dist.ReduceOp.AVG)  # the router is replicated
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {dist.get_rank()} route {route} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
