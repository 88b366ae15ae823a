"""supa_emu: an emulated Biren SUPA device for PyTorch on CPU-only machines.

This module is what PyTorch's backend autoload imports at the end of `import torch`
(entry point `torch.backends: supa_emu = supa_emu:_autoload`). It stays tiny on purpose:
unless SUPA_EMULATE asks for emulation, nothing else of the package is imported.
"""

import os

__all__ = ["activate"]


def _autoload() -> None:
    """Entry point: activates emulation when SUPA_EMULATE asks for it.

    Then, as the real package's autoload does, applies transfer_to_supa (CUDA names mean the
    SUPA card) unless SUPA_EMU_TRANSFER turns that off.
    """
    if "SUPA_EMULATE" not in os.environ:
        return  # the common case costs one dictionary lookup
    from supa_emu.switches import emulation_wanted

    if not emulation_wanted():
        return
    try:
        from supa_emu.config import emulation_requested  # validates the value

        if emulation_requested() and activate():
            from supa_emu import process_state, torch_supa

            if process_state.config().transfer:
                torch_supa._autoload()
    except Exception as error:
        _say_before_torch_wraps(error)
        raise


def _say_before_torch_wraps(error: Exception) -> None:
    """Prints the project's own message on one line before torch re-raises it.

    torch's autoload replaces any exception with a generic "Failed to load the backend
    extension" RuntimeError; ours would only show up in the chained traceback above it.
    """
    import sys

    from supa_emu.config import ConfigError

    if isinstance(error, ConfigError):
        print(f"supa_emu: configuration error: {error}", file=sys.stderr, flush=True)
    else:
        print(f"supa_emu: activating the emulator failed: {type(error).__name__}: "
              f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}", file=sys.stderr, flush=True)


def activate() -> bool:
    """Turns emulation on in this process (idempotent).

    Returns False, and registers nothing, when a real torch_supa is installed.
    """
    from supa_emu import activation

    if not activation.activate():
        return False
    _import_torch_supa()
    return True


def _import_torch_supa() -> None:
    """Imports the emulated torch_supa, as the real autoload imports the real package (whose import
    applies torch_supa.contrib.module), leaving the autoload setting as it was: only a script's own
    `import torch_supa` before torch turns it off."""
    before = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
    from supa_emu import torch_supa  # noqa: F401

    if before is None:
        os.environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    else:
        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = before
