"""Asks for 80 MiB in two allocations of 40 (run with a smaller card): the second one an operator's
result, which shapes mode allocates without running the kernel."""
import torch
import torch.distributed as dist

dist.init_process_group("bccl")
keep = torch.empty(40 << 20, dtype=torch.uint8, device="supa")
more = torch.ones(40 << 20, dtype=torch.uint8, device="supa")
