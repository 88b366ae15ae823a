"""The native core is built once per machine for the installed torch, rebuilt when its
sources change, and safe to build from several ranks starting at once."""

import os
import shutil
import subprocess
import sys

import pytest

from supa_emu import native


def test_build_key_follows_the_sources(tmp_path, monkeypatch):
    sources = tmp_path / "csrc"
    shutil.copytree(native.SOURCE_DIR, sources)
    monkeypatch.setattr(native, "SOURCE_DIR", sources)
    key = native.build_key()
    assert key == native.build_key()
    with open(sources / "module.cpp", "a") as f:
        f.write("\n// edited\n")
    assert native.build_key() != key


@pytest.mark.slow
@pytest.mark.emulation_only
def test_concurrent_ranks_build_once(tmp_path):
    env = dict(os.environ, SUPA_EMULATE="1", SUPA_EMU_CACHE_DIR=str(tmp_path))
    code = "import torch; print(torch.ones(2, device='supa').sum().item())"
    ranks = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [rank.communicate(timeout=1200) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], results
    assert [out.strip() for out, _ in results] == ["2.0", "2.0"]
    assert sum(err.count("building the native core") for _, err in results) == 1
    # A later process finds the cached build and does not compile again.
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "building the native core" not in again.stderr
