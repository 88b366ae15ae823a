"""A small transformer trained with DeepSpeed's Ulysses sequence parallelism, two Adam steps.

    ulysses.py SP

The world is WORLD / SP data-parallel replicas of an SP-rank sequence-parallel group (ranks
r // SP * SP ... + SP - 1). Each rank holds SEQ / SP tokens of every sequence; attention is
deepspeed.sequence.layer.DistributedAttention around scaled_dot_product_attention: all_to_all
over the sequence-parallel group gives each rank the whole sequence for its share of the heads,
and back. The parameters are replicated, so their gradients are averaged over the whole world.
Runs in a planner section named "ulysses".
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
import deepspeed
from deepspeed.sequence.layer import DistributedAttention

from supa_emu.plan import section

SEQ, BATCH, DIM, HEADS, LAYERS, VOCAB = 1024, 4, 128, 8, 2, 512
sp = int(sys.argv[1])

torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
deepspeed.init_distributed()  # DistributedAttention asks deepspeed.comm for the group size
device = torch.device("supa", torch.supa.current_device())
rank, world = dist.get_rank(), dist.get_world_size()
sp_group = None
for first in range(0, world, sp):  # every rank creates every group, as new_group requires
    group = dist.new_group(list(range(first, first + sp)))
    if first <= rank < first + sp:
        sp_group = group
sp_rank = dist.get_rank(sp_group)


def local_attention(query, key, value):
    """[batch, seq, heads, head_dim] in and out (Ulysses' layout), causal SDPA over the whole sequence."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                         is_causal=True)
    return out.transpose(1, 2)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))
        # batch first: heads are scattered (dim 2), the sequence gathered (dim 1)
        self.attention = DistributedAttention(local_attention, sp_group, scatter_idx=2, gather_idx=1)

    def forward(self, x):
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, HEADS, DIM // HEADS).unbind(2)
        x = x + self.proj(self.attention(q, k, v, 0).reshape(batch, tokens, DIM))
        return x + self.mlp(self.norm2(x))


def train() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), *[Block() for _ in range(LAYERS)],
                                torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, VOCAB)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    shard = SEQ // sp
    for step in range(2):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
        inputs = tokens[:, sp_rank * shard:(sp_rank + 1) * shard]
        targets = tokens[:, sp_rank * shard + 1:(sp_rank + 1) * shard + 1]
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"ulysses: step {step} loss {loss.item():.4f}", flush=True)


with section("ulysses"):
    train()
dist.destroy_process_group()
