"""Makes `import torch_supa` (and, with SUPA_EMU_EXT=1, `import torch_supa_ext`) resolve to
the emulator's modules while emulation is active, the way the real packages would import; and
runs a callback right after a module of PyTorch's is first imported (`call_after_import`), so that
registrations into modules that cost seconds to import wait until a program imports them.

Two finders: the one activation installs (first on sys.meta_path, once activation has checked
that no real torch_supa exists), and the start-up one that `supa_emu.pth` appends when
SUPA_EMULATE is on, so that `import torch_supa` also works as a script's first import, before
torch. The start-up finder comes last, so a real torch_supa on sys.path always wins.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

# Public module name -> the emulator module that plays it.
_BASE_ALIASES = {
    "torch_supa": "supa_emu.torch_supa",
    "torch_supa.supa": "supa_emu.supa",
    "torch_supa.distributed": "supa_emu.distributed",
    "torch_supa.multiprocessing": "supa_emu.multiprocessing",
}
_EXT_ALIASES = {"torch_supa_ext": "supa_emu.torch_supa_ext"}


class _AliasLoader(importlib.abc.Loader):
    is_supa_emu_alias = True

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # the target module already ran


class EmulatedPackageFinder(importlib.abc.MetaPathFinder):
    def __init__(self, aliases: dict[str, str]):
        self.aliases = aliases

    def target_of(self, fullname: str) -> str | None:
        # The longest public name that is `fullname` or a package above it decides the target.
        for public in sorted(self.aliases, key=len, reverse=True):
            if fullname == public or fullname.startswith(public + "."):
                return self.aliases[public] + fullname[len(public):]
        return None

    def find_spec(self, fullname, path=None, target=None):
        module = self.target_of(fullname)
        # Finding must not import the target: activation itself asks whether torch_supa can be
        # found, and importing supa_emu.torch_supa activates (a re-entrant call, a deadlock).
        target_spec = None if module is None else importlib.util.find_spec(module)
        if target_spec is None:
            return None
        is_package = target_spec.submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_package)


_finder: EmulatedPackageFinder | None = None


def install_startup_finder() -> None:
    """Called from supa_emu.pth at interpreter start when SUPA_EMULATE is on. Imports nothing."""
    if not any(isinstance(finder, EmulatedPackageFinder) for finder in sys.meta_path):
        sys.meta_path.append(EmulatedPackageFinder(dict(_BASE_ALIASES)))


def install(ext: bool) -> None:
    global _finder
    if _finder is None:
        aliases = dict(_BASE_ALIASES)
        if ext:
            aliases.update(_EXT_ALIASES)
        _finder = EmulatedPackageFinder(aliases)
        sys.meta_path.insert(0, _finder)


class _RunAfterExec(importlib.abc.Loader):
    """Runs the real loader of a module, then the callbacks; everything else is the real loader's."""

    def __init__(self, loader: importlib.abc.Loader, callbacks: list) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect/linecache
        return getattr(self._loader, name)


class _AfterImportHook(importlib.abc.MetaPathFinder):
    """Wraps the loader of each watched module, once, so that its callbacks run after it has run."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {}

    def find_spec(self, fullname, path=None, target=None):
        callbacks = self.pending.pop(fullname, None)
        if callbacks is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfterExec(spec.loader, callbacks)
        return spec


_after_import = _AfterImportHook()


def call_after_import(module: str, callback: Callable[[], None]) -> None:
    """Calls `callback` once `module` has been imported: now if it already is."""
    if module in sys.modules:
        callback()
        return
    _after_import.pending.setdefault(module, []).append(callback)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)
