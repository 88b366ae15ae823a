"""Shared test setup: markers and helpers for running code in fresh processes.

Tests are written against public APIs (torch.supa, get_accelerator()) so that the same
files run on a real card; `emulation_only` marks those that test the emulator itself.
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch  # noqa: F401  (activates the emulator under SUPA_EMULATE=1, as in user code)


def _emulated() -> bool:
    try:
        from supa_emu import activation
    except ImportError:
        return False
    return activation.is_active()


def pytest_collection_modifyitems(config, items):
    if _emulated():
        return
    skip = pytest.mark.skip(reason="tests the emulator; run with SUPA_EMULATE=1 on a machine without torch_supa")
    for item in items:
        if "emulation_only" in item.keywords:
            item.add_marker(skip)


def run_python(code: str, env: dict | None = None, timeout: float = 300, check: bool = True):
    """Runs `code` in a fresh interpreter (so autoload and env handling are exercised for real)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    for name, value in list(full_env.items()):
        if value is None:
            del full_env[name]
    # A script file rather than -c, so that multiprocessing's spawn can re-import __main__.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(textwrap.dedent(code))
    try:
        result = subprocess.run([sys.executable, script.name], env=full_env, capture_output=True, text=True,
                                timeout=timeout)
    finally:
        os.unlink(script.name)
    if check and result.returncode != 0:
        raise AssertionError(f"subprocess failed ({result.returncode}):\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


@pytest.fixture
def python_subprocess():
    return run_python
