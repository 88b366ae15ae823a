"""Makes `import torch_supa` (and, with SUPA_EMU_EXT=1, `import torch_supa_ext`) resolve to
the emulator's modules while emulation is active, the way the real packages would import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

# Public module name -> the emulator module that plays it.
_BASE_ALIASES = {
    "torch_supa": "supa_emu.torch_supa",
    "torch_supa.supa": "supa_emu.supa",
    "torch_supa.distributed": "supa_emu.distributed",
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
        if fullname in self.aliases:
            return self.aliases[fullname]
        for public, target in self.aliases.items():
            if fullname.startswith(public + "."):
                return target + fullname[len(public):]
        return None

    def find_spec(self, fullname, path=None, target=None):
        module = self.target_of(fullname)
        if module is None or importlib.util.find_spec(module) is None:
            return None
        is_package = hasattr(importlib.import_module(module), "__path__")
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_package)


_finder: EmulatedPackageFinder | None = None


def install(ext: bool) -> None:
    global _finder
    if _finder is None:
        aliases = dict(_BASE_ALIASES)
        if ext:
            aliases.update(_EXT_ALIASES)
        _finder = EmulatedPackageFinder(aliases)
        sys.meta_path.insert(0, _finder)
