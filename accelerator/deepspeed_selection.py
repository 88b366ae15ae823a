"""Makes DeepSpeed's get_accelerator() return this project's SUPA_Accelerator when DeepSpeed picks SUPA.

`install()` is meant to run at `import torch` time (from a `torch.backends` entry point), which is
before DeepSpeed is imported in every process: plain scripts, deepspeed-launcher and torchrun
ranks, multiprocessing children. It imports nothing heavy (no torch, DeepSpeed or supa_emu) and
does nothing until DeepSpeed loads.

The setting SUPA_DS_ACCELERATOR chooses which SUPA accelerator DeepSpeed gets:
'project' (default) for this project's supa_deepspeed.accelerator.supa_accelerator.SUPA_Accelerator, 'builtin' for DeepSpeed's
own deepspeed.accelerator.supa_accelerator.SUPA_Accelerator.
"""

import sys
import threading

_TARGET = "deepspeed.accelerator.real_accelerator"
_WRAPPED_MARK = "__supa_emu_selection__"

_install_lock = threading.Lock()
_choice_lock = threading.RLock()


def selected_implementation():
    """'project' or 'builtin' from SUPA_DS_ACCELERATOR (default 'project'); ValueError otherwise."""
    from supa_emu.config import deepspeed_accelerator  # the project's one parser of SUPA_* settings

    return deepspeed_accelerator()


def install():
    """Arrange for DeepSpeed's SUPA choice to become the project's accelerator. Idempotent, thread-safe."""
    with _install_lock:
        if not any(isinstance(finder, _RealAcceleratorFinder) for finder in sys.meta_path):
            sys.meta_path.insert(0, _RealAcceleratorFinder())
    # DeepSpeed may already be loaded (install() called late): patch the live module too.
    module = sys.modules.get(_TARGET)
    if module is not None and hasattr(module, "get_accelerator"):
        _wrap_get_accelerator(module)


# The one monkeypatch of this project in DeepSpeed: real_accelerator.get_accelerator is replaced,
# right after that module executes, by a wrapper that lets DeepSpeed make its own choice (its
# DS_ACCELERATOR override and auto-detection, errors included) and, when that choice is DeepSpeed's
# built-in SUPA accelerator, installs ours through DeepSpeed's public set_accelerator instead.
# Patching at module-execution time matters: deepspeed/accelerator/__init__.py re-exports the name
# with `from .real_accelerator import get_accelerator`, and every other module imports it by name,
# so all of them must see the wrapper from the start. Explicit set_accelerator() calls by users are
# left alone: the wrapper only acts while DeepSpeed has not chosen yet.
def _wrap_get_accelerator(module):
    original = module.get_accelerator
    if getattr(original, _WRAPPED_MARK, False):
        return

    def get_accelerator():
        if module.ds_accelerator is not None:
            return module.ds_accelerator
        with _choice_lock:
            if module.ds_accelerator is not None:
                return module.ds_accelerator
            # Read before DeepSpeed chooses, so a bad value fails every call, not just the first.
            implementation = selected_implementation()
            chosen = original()
            if getattr(chosen, "_name", None) != "supa":
                _say_when_supa_was_expected(chosen, implementation)
            elif implementation == "project":
                _install_project_accelerator(module, chosen)
            return module.ds_accelerator

    get_accelerator.__doc__ = original.__doc__
    get_accelerator.__wrapped__ = original
    setattr(get_accelerator, _WRAPPED_MARK, True)
    module.get_accelerator = get_accelerator


def _install_project_accelerator(module, builtin):
    try:
        from .supa_accelerator import SUPA_Accelerator
        if isinstance(builtin, SUPA_Accelerator):
            return
        ours = SUPA_Accelerator()
    except Exception as exc:  # a broken install must not take DeepSpeed down with it, nor pass unnoticed
        _log().warning("DeepSpeed uses its built-in SUPA accelerator (%s.%s), not this project's "
                       "(SUPA_DS_ACCELERATOR=project): loading %s.supa_accelerator failed: %s: %s",
                       type(builtin).__module__, type(builtin).__qualname__, __package__,
                       type(exc).__name__, exc)
        return
    module.set_accelerator(ours)


def _say_when_supa_was_expected(chosen, implementation):
    """One line when DeepSpeed picked another accelerator although SUPA is there or was asked for."""
    import os
    torch = sys.modules.get("torch")
    supa_present = torch is not None and hasattr(torch, "supa")
    if not (supa_present or "SUPA_DS_ACCELERATOR" in os.environ):
        return  # SUPA is not in play in this process: nothing was expected of it
    requested = os.environ.get("DS_ACCELERATOR")
    why = (f"DS_ACCELERATOR={requested}" if requested else
           "DeepSpeed's auto-detection did not pick SUPA" + ("" if supa_present else " (no torch.supa here)"))
    _log().warning("DeepSpeed uses its '%s' accelerator (%s.%s), not SUPA_DS_ACCELERATOR=%s's SUPA accelerator: %s",
                   getattr(chosen, "_name", "?"), type(chosen).__module__, type(chosen).__qualname__,
                   implementation, why)


def _log():
    import logging
    return logging.getLogger(__name__)


class _RealAcceleratorFinder:
    """Meta-path finder that only watches for DeepSpeed's real_accelerator module."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader:
    """Runs the real loader, then wraps get_accelerator; everything else goes to the real loader."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _wrap_get_accelerator(module)

    def __getattr__(self, name):
        # get_source, get_filename, is_package, ... keep working for tracebacks and inspect.
        return getattr(self._loader, name)
