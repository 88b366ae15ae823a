"""Shared test setup: markers and helpers for running code in fresh processes.

Tests are written against public APIs (torch.supa, get_accelerator()) so that the same
files run on a real card; `emulation_only` marks those that test the emulator itself.
"""

import atexit
import fcntl
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest


def _claim_torch_extensions_dir() -> None:
    """Gives this test run a directory for torch's JIT-built host ops (DeepSpeed's cpu_adam & co.).

    torch marks a build in progress with a `lock` file in the op's build directory and makes
    every later build of that op wait for it to go away; a build that was killed leaves it
    behind, and the next run then hangs without a word (seen: a CI run hung on a lock left by
    an interrupted session). The run holds its directory under flock, so a `lock` file found
    there at start-up belongs to no live build and is removed. Concurrent runs take other slots.
    A TORCH_EXTENSIONS_DIR set by the user is left alone.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    for slot in range(8):
        directory = base / "supa_emu-tests" / f"torch_extensions-{slot}"
        directory.mkdir(parents=True, exist_ok=True)
        holder = open(directory / ".held-by-a-test-run", "a")
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder.close()
            continue
        for stale in directory.glob("*/lock"):
            stale.unlink()
        atexit.register(holder.close)  # the lock lasts as long as this process (its children are done by then)
        os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="supa_emu-torch_extensions-")


_claim_torch_extensions_dir()

# The one-time transfer_to_supa banner (and its TorchScript notice) would otherwise land in the
# stderr of every test's subprocess; the tests of the banner itself unset this.
os.environ.setdefault("BRTB_TRANSFER_SILENCE", "1")

import torch  # noqa: E402,F401  (activates the emulator under SUPA_EMULATE=1, as in user code)


def _emulated() -> bool:
    try:
        from supa_emu import activation
    except ImportError:
        return False
    return activation.is_active()


def pytest_collection_modifyitems(config, items):
    # The emulated torch_supa_ext op tests run in a child pytest with SUPA_EMU_EXT=1
    # (test_torch_supa_ext.py::test_ext_suite_in_subprocess, which prints the child's count in
    # this run's summary); here they are deselected, so that the summary's skips are real ones.
    if os.environ.get("SUPA_EMU_EXT") != "1":
        in_child = [item for item in items if "ext_ops" in item.keywords]
        if in_child:
            config.hook.pytest_deselected(items=in_child)
            items[:] = [item for item in items if "ext_ops" not in item.keywords]
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


def run_scenario(code: str, env: dict | None = None, timeout: float = 300):
    """Runs `code` with run_python and returns what it printed as JSON on a line 'RESULT <json>'."""
    result = run_python(code, env=env, timeout=timeout)
    for line in result.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"no RESULT line in the output:\n{result.stdout}\n{result.stderr}")


def free_port() -> int:
    """A loopback port that was free a moment ago (for a rendezvous the test starts next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_RANK_RESULT = "RANK-RESULT "


def run_ranks(script: str, scenario: str, world: int = 2, limit_s: float = 240, env: dict | None = None) -> list:
    """Start `world` ranks of a multi-process scenario; return each rank's (returncode, outcome, stderr).

    Each rank is `python script scenario rank port` with SUPA_EMULATE=1 and this checkout first on
    the path; the script's `__main__` hands over to `serve_rank(globals())`, which runs its
    `_scenario_<scenario>(rank, port)` and prints the JSON outcome that is returned here (None if
    the rank printed none). A job still running after `limit_s` is killed and fails the test.
    """
    port = free_port()
    full_env = dict(os.environ, SUPA_EMULATE="1", **(env or {}))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, full_env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(script), scenario, str(rank), str(port)],
            env=full_env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in range(world)
    ]
    results = []
    deadline = time.monotonic() + limit_s
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"job {scenario!r} of {os.path.basename(script)} hung (> {limit_s}s)")
        lines = [line for line in out.splitlines() if line.startswith(_RANK_RESULT)]
        results.append((proc.returncode, json.loads(lines[-1][len(_RANK_RESULT):]) if lines else None, err))
    return results


class RankChecks:
    """A rank's named checks: `check(name, fn)` records "ok" or the error fn raised, for the parent test."""

    def __init__(self):
        self.outcomes = {}

    def __call__(self, name, fn):
        try:
            fn()
            self.outcomes[name] = "ok"
        except Exception as error:  # recorded, asserted by the parent test
            self.outcomes[name] = f"{type(error).__name__}: {error}"


def print_line(text: str) -> None:
    """Writes `text` and its newline to stdout in one system call: ranks that share a pipe then never
    interleave inside each other's lines (print() may write the text and the newline apart)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def serve_rank(namespace: dict) -> None:
    """Entry point of a rank started by run_ranks: run the scenario named on the command line."""
    scenario, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    outcome = namespace[f"_scenario_{scenario}"](rank, port)
    print_line(_RANK_RESULT + json.dumps(outcome))
    os._exit(0)  # skip interpreter teardown: peers may already be gone in the failure scenarios


_CHILD_RUNS: list[str] = []


@pytest.fixture
def report_child_run():
    """Adds a line (e.g. a child pytest's summary) to this run's terminal summary."""
    return _CHILD_RUNS.append


def pytest_terminal_summary(terminalreporter):
    for line in _CHILD_RUNS:
        terminalreporter.write_line(line)


@pytest.fixture
def python_subprocess():
    return run_python


def behaviour_table():
    """A `{name: check}` table and the decorator that fills it (`@check("a", "b")` registers the
    function as the check of both names), for tests that give every name of an API a check."""
    checks = {}

    def check(*names):

        def register(fn):
            for name in names:
                checks[name] = fn
            return fn

        return register

    return checks, check


@pytest.fixture
def restore_supa_device():
    """Initialises torch.supa and makes the device current before the test current again after it."""
    import torch

    torch.supa.init()
    previous = torch.supa.current_device()
    yield
    torch.supa.set_device(previous)
