"""Packaging hook: installs `supa_emu.pth` next to the packages (everything else is in pyproject.toml).

The .pth line runs at interpreter start-up. With SUPA_EMULATE off it costs one environment
lookup; with it on, it lets `import torch_supa` work as the first import of a script (before
torch), as with the real package, by appending a finder that yields to a real torch_supa.
"""

import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "supa_emu.pth"
PTH_LINE = (
    'import os; os.environ.get("SUPA_EMULATE", "0").strip().lower() in ("", "0", "false", "no", "off") '
    'or __import__("supa_emu.import_hooks").import_hooks.install_startup_finder()\n'
)


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        self._pth_path().write_text(PTH_LINE)

    def _pth_path(self) -> pathlib.Path:
        # A wheel takes what build_lib holds; an editable wheel ignores build_lib and takes what
        # is written straight into its unpacked tree, which the install command points at.
        root = self.distribution.get_command_obj("install").install_lib if self.editable_mode else None
        path = pathlib.Path(root or self.build_lib) / PTH_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [str(self._pth_path())]


setup(cmdclass={"build_py": BuildPyWithStartupHook})
