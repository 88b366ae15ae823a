"""Starts its own two ranks with torch.multiprocessing instead of being started as one."""
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank):
    dist.init_process_group("bccl", rank=rank, world_size=2)


if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
