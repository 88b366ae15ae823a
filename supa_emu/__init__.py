"""supa_emu: an emulated Biren SUPA device for PyTorch on CPU-only machines.

This module is what PyTorch's backend autoload imports at the end of `import torch`
(entry point `torch.backends: supa_emu = supa_emu:_autoload`). It stays tiny on purpose:
unless SUPA_EMULATE asks for emulation, nothing else of the package is imported.
"""

import os

__all__ = ["activate"]


def _autoload() -> None:
    """Entry point: activates emulation when SUPA_EMULATE asks for it."""
    if os.environ.get("SUPA_EMULATE", "0").strip() in ("", "0"):
        return  # the common case costs one dictionary lookup
    from supa_emu.config import emulation_requested  # validates the value

    if emulation_requested():
        activate()


def activate() -> bool:
    """Turns emulation on in this process (idempotent).

    Returns False, and registers nothing, when a real torch_supa is installed.
    """
    from supa_emu import activation

    return activation.activate()
