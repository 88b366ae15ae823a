"""Run as `python -m planned_pkg.train OUT`: its peak is in fill_the_card; writes (sys.argv, __name__) to OUT.<rank>."""
import sys

import torch
import torch.distributed as dist


def fill_the_card():
    return torch.empty(1 << 22, device="supa")  # the peak: 16 MiB


dist.init_process_group("bccl")
keep = fill_the_card()
with open(sys.argv[1] + f".{dist.get_rank()}", "w") as f:
    f.write(repr((sys.argv, __name__)))
dist.destroy_process_group()
