"""The emulated `torch_supa` package: what `import torch_supa` gives under emulation.

Importing it does what importing the real package does (docs/real_stack.md, "Device registration
and autoload"): it turns PyTorch's
backend autoload off before importing torch (so a script that starts with `import torch_supa`
gets the native `supa` device only, without the CUDA transfer), makes sure the device is
registered, applies `torch_supa.contrib.module`, and offers `_autoload()`, which applies `torch_supa.contrib.transfer_to_supa` and
restores the autoload setting, as the real autoload hook does.
"""

import os

ORG_AUTOLOAD = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # as the real package: no autoload from here on

import torch  # noqa: E402

from supa_emu import activation  # noqa: E402

activation.activate()

from supa_emu import supa  # noqa: E402,F401
from supa_emu.torch_supa.contrib import module  # noqa: E402,F401  (its patches apply on import)

__version__ = f"1.0.0.{''.join(torch.__version__.split('+')[0].split('.')[:2])}00+emulated"
__supa_version__ = "emulated"


def _autoload() -> None:
    """The real package's autoload hook: apply transfer_to_supa, restore the autoload setting."""
    os.environ["IS_CUSTOM_DEVICE_BACKEND_IMPORTED"] = "1"
    from supa_emu.torch_supa.contrib import transfer_to_supa  # noqa: F401  (applies on import)

    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = ORG_AUTOLOAD
