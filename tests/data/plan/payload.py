"""A control value and two large payloads through all_reduce and all_gather; each rank writes what it
holds afterwards to <argv[1]>.<rank>."""
import json
import sys

import torch
import torch.distributed as dist

dist.init_process_group("bccl")
flag = torch.ones(4).to("supa")          # 16 bytes: a control value, as an overflow flag
big = torch.ones(1 << 15).to("supa")     # 128 KiB written from the host
gathered = torch.zeros(big.numel() * dist.get_world_size()).to("supa")
dist.all_reduce(flag)
dist.all_reduce(big)
dist.all_gather_into_tensor(gathered, big)
with open(sys.argv[1] + f".{dist.get_rank()}", "w") as f:
    json.dump({"flag": flag.tolist(), "big": big[:2].tolist(), "gathered": gathered[-2:].tolist()}, f)
dist.destroy_process_group()
