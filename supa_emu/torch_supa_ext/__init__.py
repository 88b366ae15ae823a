"""Emulated ``torch_supa_ext`` 2.12.0a1: the real op surface on the emulated ``supa`` device.

Served as ``torch_supa_ext`` by supa_emu's import hook when emulation is on and
``SUPA_EMU_EXT=1``. Importing it does what importing the real package does: registers the
``deepspeed::`` ops with SUPA kernels (here reference kernels in plain PyTorch), the
``deepspeed::`` and ``dc::`` stubs that raise NotImplementedError, and provides the stub classes
in ``torch_supa_ext.deepspeed_classes`` (the four groups of docs/real_stack.md,
"torch_supa_ext"). Registration is idempotent, so importing it again, or under its other name,
changes nothing.
"""

from . import deepspeed, deepspeed_classes, stub_ops  # noqa: F401  (importing registers the ops)

__version__ = "2.12.0a1"

# What a caller can check to tell this package from the real one.
EMULATED = True
__emulated_by__ = "supa_emu"
