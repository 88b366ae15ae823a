"""Builds 1 GiB of float32 weights on the host, the way a 70B script must not (run with a small
SUPA_PLAN_HOST_MEMORY)."""
import torch
import torch.distributed as dist

dist.init_process_group("bccl")
layers = [torch.nn.Linear(8192, 8192, bias=False) for _ in range(4)]
