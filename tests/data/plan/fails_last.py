"""The last rank raises before the barrier the others wait in."""
import torch.distributed as dist

dist.init_process_group("bccl")
if dist.get_rank() == dist.get_world_size() - 1:
    raise ValueError("the last rank has no data")
dist.barrier()
