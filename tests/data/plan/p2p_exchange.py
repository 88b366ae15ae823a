"""Point-to-point messages of a planned world: what a played receiver gets, and what a plan cannot run.

    p2p_exchange.py OUT values    ranks 1 and 3 exchange over a subgroup: sizes (int64, 800 KB), a small
                                  float tensor, a large one (1 MiB); rank 3 writes what it received to OUT.3
    p2p_exchange.py OUT crossed   ranks 0 and 1 each receive from the other before sending (a real job hangs)
    p2p_exchange.py OUT silent    rank 0 receives from rank 1, which ends without sending
"""
import json
import os
import sys

import torch
import torch.distributed as dist

out, case = sys.argv[1], sys.argv[2]
torch.supa.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("bccl")
rank = dist.get_rank()
pair = dist.new_group([1, 3]) if case == "values" else None
if case == "values":
    sizes = torch.arange(100_000, dtype=torch.int64, device="supa") * (rank + 1)
    small = torch.full((4,), float(rank), device="supa")
    large = torch.full((1 << 18,), float(rank), device="supa")
    if rank == 1:
        dist.send(sizes, dst=3, group=pair, tag=7)
        dist.send(small, dst=3, group=pair)
        dist.send(large, dst=3, group=pair)
    elif rank == 3:
        dist.recv(small, src=1, group=pair)  # tag 0: the small tensor, though the sizes were sent first (tag 7)
        dist.recv(sizes, src=1, group=pair, tag=7)
        dist.recv(large, src=1, group=pair)
        with open(f"{out}.{rank}", "w") as result:
            json.dump({"sizes_sum": sizes.sum().item(), "small": small.tolist(), "large": large[:2].tolist()}, result)
elif rank in (0, 1):
    peer = 1 - rank
    size = torch.zeros(1, dtype=torch.int64, device="supa")
    if case == "crossed" or rank == 0:
        dist.recv(size, src=peer)
    if case == "crossed":
        dist.send(size, dst=peer)
dist.destroy_process_group()
