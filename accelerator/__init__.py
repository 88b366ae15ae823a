"""DeepSpeed accelerator for Biren SUPA GPUs: `SUPA_Accelerator`, and the hook that selects it.

Installed as `supa_deepspeed.accelerator` (see setup.py), so it never takes the import name of
DeepSpeed's own top-level `accelerator` folder. It is still import-free: importing it costs nothing,
does not import DeepSpeed back and does not offer DeepSpeed's names (`get_accelerator`,
`abstract_accelerator`), so that it also reads correctly when vendored into DeepSpeed's tree.
"""

__all__ = ["SUPA_Accelerator"]


def __getattr__(name):
    # Lazy so that importing the package (done by the torch.backends entry point at `import torch`)
    # does not import torch or DeepSpeed.
    if name == "SUPA_Accelerator":
        from .supa_accelerator import SUPA_Accelerator
        return SUPA_Accelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
