"""A small transformer trained with PyTorch's context parallelism (ring attention), two Adam steps.

    ring_attention.py CP ROTATE [ROTATE...]   (ROTATE: allgather or alltoall)

The world is a (dp, cp) DeviceMesh, "cp" innermost as torchtitan's. Inside
torch.distributed.tensor.experimental.context_parallel each cp rank holds a share of every sequence
(the inputs and targets are sharded in place, balanced for causal attention) and
scaled_dot_product_attention becomes ring attention: the key/value shards travel around the cp
group by all_gather or by all_to_all, as set_rotate_method says. The parameters are replicated,
so their gradients are averaged over the whole world. Each rotate method trains its own model in
a planner section of its name.
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method

from supa_emu.plan import section

SEQ, BATCH, DIM, HEADS, LAYERS, VOCAB = 1024, 4, 128, 8, 2, 512
cp = int(sys.argv[1])

torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("bccl")
device = torch.device("supa", torch.supa.current_device())
mesh = init_device_mesh("supa", (dist.get_world_size() // cp, cp), mesh_dim_names=("dp", "cp"))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.qkv, self.proj = torch.nn.Linear(DIM, 3 * DIM), torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, HEADS, DIM // HEADS).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, DIM))
        return x + self.mlp(self.norm2(x))


def train(rotate: str) -> None:
    set_rotate_method(rotate)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), *[Block() for _ in range(LAYERS)],
                                torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, VOCAB)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with context_parallel(mesh["cp"], buffers=[inputs, targets], buffer_seq_dims=[1, 1]):
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0:
            print(f"{rotate}: step {step} loss {loss.item():.4f}", flush=True)


for rotate in sys.argv[2:]:
    with section(rotate):
        train(rotate)
dist.destroy_process_group()
