"""Builds and loads the native core (`supa_emu/csrc`) for the installed torch.

The build happens once per machine and is cached under SUPA_EMU_CACHE_DIR, keyed by a hash
of the sources, the torch build and the Python version, so a new torch or edited sources
give a fresh build. A file lock makes concurrent ranks wait for one builder instead of
compiling the same thing N times.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import shutil
import sys

import torch

log = logging.getLogger("supa_emu")

SOURCE_DIR = pathlib.Path(__file__).parent / "csrc"
_CFLAGS = ["-O2"]


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in SOURCE_DIR.rglob("*") if p.suffix in (".cpp", ".h"))


def build_key() -> str:
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(str(path.relative_to(SOURCE_DIR)).encode())
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(str(torch.version.git_version).encode())
    digest.update(sys.version.encode())
    digest.update(" ".join(_CFLAGS).encode())
    return digest.hexdigest()[:16]


MODULE_NAME = "supa_emu_C"


def _import_extension(path: pathlib.Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


_C = None


def load(cache_dir: pathlib.Path):
    """Returns the compiled module, building it first if this machine has no current build.

    Builds run in one work directory per torch/Python pair, so an edit recompiles only the
    files it touched; each finished library is then published under its build key.
    """
    global _C
    if _C is not None:
        return _C
    root = cache_dir / "native"
    library = root / build_key() / f"{MODULE_NAME}.so"
    if library.exists():
        _C = _import_extension(library)
        return _C
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first rank builds, the others wait here
        if library.exists():
            _C = _import_extension(library)
        else:
            work_dir = root / f"work-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
            _C = _build(work_dir)
            library.parent.mkdir(exist_ok=True)
            staged = library.with_suffix(".tmp")
            shutil.copyfile(work_dir / f"{MODULE_NAME}.so", staged)
            os.replace(staged, library)
    return _C


def _build(work_dir: pathlib.Path):
    from torch.utils import cpp_extension

    log.warning("supa_emu: building the native core for torch %s (once per machine) in %s",
                torch.__version__, work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    # cpp_extension guards the directory with a lock file of its own, which stays behind when a
    # build is killed; under our flock no other process is building, so it is safe to clear.
    (work_dir / "lock").unlink(missing_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    return cpp_extension.load(
        name=MODULE_NAME,
        sources=[str(p) for p in _sources() if p.suffix == ".cpp"],
        build_directory=str(work_dir),
        extra_cflags=_CFLAGS,
        with_cuda=False,
        is_python_module=True,
        verbose=False,
    )
