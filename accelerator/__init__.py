"""DeepSpeed accelerator for Biren SUPA GPUs: `SUPA_Accelerator`, and the hook that selects it.

This package is deliberately import-free. DeepSpeed itself imports a top-level `accelerator`
package while it loads (it probes `accelerator.abstract_accelerator` and
`from accelerator import get_accelerator` to detect a DeepSpeed source checkout), so importing
this package must cost nothing, must not import DeepSpeed back, and must not offer those names.
"""

__all__ = ["SUPA_Accelerator"]


def __getattr__(name):
    # Lazy so that `import accelerator` (done by DeepSpeed and by the torch.backends entry point)
    # does not import torch or DeepSpeed.
    if name == "SUPA_Accelerator":
        from .supa_accelerator import SUPA_Accelerator
        return SUPA_Accelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
