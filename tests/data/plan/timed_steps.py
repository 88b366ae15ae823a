"""A small causal-attention model trained three steps with AdamW, gradients averaged by all_reduce, and
each step's batch copied to the card on a side stream that the default stream waits for (an event):
the planner's time model has matrix products, attention, element-wise work, a host copy,
asynchronous collectives (on their communicator's stream until their waits) and two streams to time. Says its tokens per step (supa_emu.plan.tokens).

    timed_steps.py
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import supa_emu.plan

BATCH, SEQ, DIM, HEADS, STEPS = 2, 64, 128, 4, 3

device = torch.device("supa", int(os.environ["LOCAL_RANK"]))
torch.supa.set_device(device)
dist.init_process_group("bccl", device_id=device)
torch.manual_seed(0)
qkv = torch.nn.Linear(DIM, 3 * DIM, device=device)
proj = torch.nn.Linear(DIM, DIM, device=device)
norm = torch.nn.LayerNorm(DIM, device=device)
params = [*qkv.parameters(), *proj.parameters(), *norm.parameters()]
optimizer = torch.optim.AdamW(params, lr=1e-3)
copies = torch.supa.Stream()
supa_emu.plan.tokens(BATCH * SEQ)

for step in range(STEPS):
    host_batch = torch.randn(BATCH, SEQ, DIM)
    with torch.supa.stream(copies):
        x = host_batch.to(device, non_blocking=True)
        arrived = torch.supa.Event()
        arrived.record()
    torch.supa.current_stream().wait_event(arrived)
    h = norm(x)
    q, k, v = qkv(h).view(BATCH, SEQ, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = proj(attended.transpose(1, 2).reshape(BATCH, SEQ, DIM))
    loss = (out.float() ** 2).mean()
    loss.backward()
    works = [dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, async_op=True) for p in params]
    for work in works:
        work.wait()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()
