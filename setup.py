"""Packaging: the import names of the three top-level folders, and the `supa_emu.pth` start-up hook.

Import names. `supa_emu/` installs as `supa_emu`. `accelerator/` and `op_builder/` keep
DeepSpeed's folder names in this repository (they are laid out to be upstreamed into those
folders), but install as `supa_deepspeed.accelerator` and `supa_deepspeed.op_builder`: a
DeepSpeed checkout puts its own top-level `accelerator` and `op_builder` on sys.path, and a
second package under either name would shadow one or the other.

The .pth line runs at interpreter start-up. With SUPA_EMULATE unset it costs one environment
lookup; set, `supa_emu.switches` (which imports only `os`) reads it. On, the line lets
`import torch_supa` work as the first import of a script (before torch), as with the real
package, by appending a finder that yields to a real torch_supa.
"""

import pathlib

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH_NAME = "supa_emu.pth"
PTH_LINE = (
    'import os; "SUPA_EMULATE" not in os.environ '
    'or __import__("supa_emu.switches").switches.emulation_wanted() '
    'and __import__("supa_emu.import_hooks").import_hooks.install_startup_finder()\n'
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


# The folders in this repository that install under another import name.
RENAMED_FOLDERS = {"supa_deepspeed.accelerator": "accelerator", "supa_deepspeed.op_builder": "op_builder"}


def _packages():
    names = find_packages(include=["supa_emu", "supa_emu.*"])
    for import_name, folder in RENAMED_FOLDERS.items():
        names.append(import_name)
        names += [f"{import_name}.{sub}" for sub in find_packages(folder)]
    return names


setup(
    packages=_packages(),
    package_dir=RENAMED_FOLDERS,
    cmdclass={"build_py": BuildPyWithStartupHook},
)
