"""torch.compile for emulated SUPA cards: registers the Dynamo device interface and the Inductor
backend for `supa`, each at the moment PyTorch first needs it.

`install()` runs at activation and imports nothing of Dynamo or Inductor (they cost seconds):
- the device interface is registered right after `torch._dynamo.device_interface` is first
  imported (an import hook), before Dynamo looks up any device;
- the Inductor backend is registered right after `torch._inductor.compile_fx` is first imported
  (before Inductor compiles anything or computes a cache key), with its configuration
  (inductor_config.py), so that Inductor's cache key sees which emulator made the code. PyTorch's
  own hook for out-of-tree backends, `init_backend_registration` asking the PrivateUse1 device
  module for its code generators (`torch.supa.Scheduling`, ... served by `codegen_class`), would
  register the backend without a configuration; if it runs first, the registration here replaces
  its entry.
"""

from __future__ import annotations

from typing import Any

from supa_emu import import_hooks
from supa_emu.device_type import DEVICE_TYPE

_DYNAMO_DEVICE_INTERFACE = "torch._dynamo.device_interface"
_INDUCTOR_COMPILE = "torch._inductor.compile_fx"

# The names Inductor's init_backend_registration looks up on the PrivateUse1 device module.
CODEGEN_NAMES = ("Scheduling", "PythonWrapperCodegen", "CppWrapperCodegen", "WrapperFxCodegen")


def codegen_class(name: str) -> Any:
    """Inductor's code generator class `name` for supa (imports the backend on first use)."""
    from supa_emu.compile import inductor_backend

    return inductor_backend.CODEGEN_CLASSES[name]


def register_device_interface(device_type: str = DEVICE_TYPE) -> None:
    """Registers `SupaInterface` with Dynamo for `device_type` and `device_type:<i>`.

    Also meant for transfer_to_supa, which calls it with "cuda" so that Dynamo answers CUDA
    device questions with the supa runtime. Safe to call before Dynamo is imported: the
    registration then happens when it is.
    """
    _pending_device_types.add(device_type)
    import_hooks.call_after_import(_DYNAMO_DEVICE_INTERFACE, _register_pending)


_pending_device_types: set[str] = set()


def _register_pending() -> None:
    import torch
    from torch._dynamo import device_interface as registry

    from supa_emu.compile.device_interface import SupaInterface

    # Dynamo fills in its built-in interfaces (cuda, cpu, ...) on first lookup; doing that now
    # keeps it from later overwriting an entry registered here (e.g. "cuda" under transfer).
    if not registry._device_initialized:
        registry.init_device_reg()
    for device_type in sorted(_pending_device_types):
        registry.register_interface_for_device(device_type, SupaInterface)
        for index in range(torch.supa.device_count()):
            registry.register_interface_for_device(f"{device_type}:{index}", SupaInterface)


def _register_inductor_backend() -> None:
    from torch._inductor.codegen.common import register_backend_for_device

    from supa_emu.compile import inductor_backend, inductor_config

    classes = inductor_backend.CODEGEN_CLASSES
    register_backend_for_device(DEVICE_TYPE, *(classes[name] for name in CODEGEN_NAMES),
                                device_custom_config=inductor_config)


def install() -> None:
    """Called at activation: arranges the lazy registrations; imports nothing of torch._dynamo."""
    register_device_interface(DEVICE_TYPE)
    import_hooks.call_after_import(_INDUCTOR_COMPILE, _register_inductor_backend)
