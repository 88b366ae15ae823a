"""The emulated `torch_supa` package: what `import torch_supa` gives under emulation.

It exposes the same entry points as the real package (`torch_supa.supa` is `torch.supa`,
`_autoload`, `__version__`), with a version string that says it is the emulator.
"""

import torch

from supa_emu import supa

__version__ = f"1.0.0.{''.join(torch.__version__.split('+')[0].split('.')[:2])}00+emulated"
__supa_version__ = "emulated"
ORG_AUTOLOAD = "1"


def _autoload() -> None:
    """The real package's autoload hook; under emulation the device is already registered."""
