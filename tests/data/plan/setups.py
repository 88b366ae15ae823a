"""Runs several training scripts one after the other in one process, each in a planner section.

    setups.py '[[name, script, *args], ...]'

Every setup in one job: the fixed cost of a rank process (importing torch, DeepSpeed, transformers)
is paid once per job rather than once per setup (tests/test_plan.py's exactness jobs).
"""
import gc
import json
import runpy
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from supa_emu.plan import section

for index, (name, script, *args) in enumerate(json.loads(sys.argv[1])):
    # destroy_process_group restarts group names at 0, and a rendezvous under a used name would
    # read the previous script's peers from the job's store: each script's groups get new names.
    distributed_c10d._world.group_count = 1000 * index
    sys.argv = [script, *args]
    with section(name):
        runpy.run_path(script, run_name="__main__")
    if dist.is_initialized():  # the next script starts, as in a fresh process, with no group
        dist.destroy_process_group()
    gc.collect()
    torch.supa.empty_cache()
