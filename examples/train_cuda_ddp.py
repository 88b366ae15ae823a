"""A data-parallel training script written for CUDA GPUs: it runs unchanged on SUPA cards.

Nothing in it names SUPA. On a SUPA machine `import torch` applies transfer_to_supa, so "cuda"
means the SUPA card and "nccl" means "bccl". Run on two emulated cards:

    SUPA_EMULATE=1 torchrun --nproc-per-node 2 examples/train_cuda_ddp.py

It trains a small regression MLP with DistributedDataParallel, bf16 autocast and AdamW, times
every step with CUDA events and prints, per rank, one JSON line with the losses, step times,
peak memory and a checksum of the final parameters (equal on every rank when DDP worked).
"""

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def batch(step: int, rank: int, size: int, generator: torch.Generator):
    """Inputs and targets of a fixed random linear map; every (step, rank) gets its own samples."""
    generator.manual_seed(1000 * step + rank)
    x = torch.randn(size, 32, generator=generator)
    w = torch.linspace(-1, 1, 32 * 8).reshape(32, 8)
    return x, x @ w + 0.01 * torch.randn(size, 8, generator=generator)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()
    ddp = DistributedDataParallel(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    generator = torch.Generator()

    losses, step_ms = [], []
    for step in range(args.steps):
        x, y = batch(step, rank, args.batch, generator)
        x, y = x.cuda(non_blocking=True), y.to("cuda", non_blocking=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            prediction = ddp(x)
        loss = F.mse_loss(prediction.float(), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        losses.append(loss.item())
        step_ms.append(start.elapsed_time(end))

    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu()
    # One write per line: the ranks share the launcher's stdout, and print() writes the text and
    # its newline separately, so lines of two ranks could interleave.
    sys.stdout.write(json.dumps({
        "event": "result",
        "rank": rank,
        "device": str(next(model.parameters()).device),
        "is_cuda": next(model.parameters()).is_cuda,
        "backend": dist.get_backend(),
        "losses": losses,
        "step_ms": step_ms,
        "memory_allocated": torch.cuda.memory_allocated(),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "parameters_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
    }) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
