"""torchtitan 0.3.0 configs for torch 2.13 on SUPA cards: pass as `--module torchtitan_supa`.

torchtitan 0.3.0 is built against a PyTorch nightly; two of its defaults need what torch 2.13
does not have. Everything else is torchtitan's own llama3 debug config.
"""

import torch.distributed as dist
from torchtitan.models.llama3.config_registry import llama3_debugmodel as _llama3_debugmodel

if not hasattr(dist, "set_timeout"):
    # The trainer calls torch.distributed.set_timeout after the first step; torch 2.13 has
    # the same operation only as a ProcessGroup method.
    def _set_timeout(timeout, group=None):
        (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)

    dist.set_timeout = _set_timeout


def llama3_debugmodel():
    config = _llama3_debugmodel()
    # The default "spmd_types" backend hands fully_shard plain tensors with dp_mesh_dims, which
    # torch 2.13's FSDP2 refuses ("all parameters must be DTensors on the full SPMD mesh").
    config.parallelism.spmd_backend = "partial_dtensor"
    return config
