"""Inductor's configuration for the `supa` backend: what makes compiled code for supa differ between
emulator versions, so that it is part of the key of Inductor's on-disk FX graph cache.

Inductor keys a compiled graph by the graph, its inputs, torch's own configuration and each
backend's `device_custom_config` (`register_backend_for_device`), but not by the code of an
out-of-tree backend. Compiled code calls the emulator's lowering and its kernels by name and
schema (`supa_emu::flex_attention`, ...), so code compiled by one supa-emu and found in the cache
by another can call an op whose schema has since changed. `emulator_fingerprint` is a digest of
this package's sources (the lowering) and of the native core's build key (the kernels); a
different supa-emu gives a different key, and Inductor compiles again.
"""

import hashlib
import pathlib
import sys

from torch.utils._config_module import install_config_module

from supa_emu import native


def _fingerprint() -> str:
    digest = hashlib.sha256(native.build_key().encode())
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# A digest of the supa lowering and kernels that compiled code was made for (see the module doc).
emulator_fingerprint: str = _fingerprint()

install_config_module(sys.modules[__name__])
