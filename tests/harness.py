"""The one way tests start processes: fresh interpreters, rank jobs, torchrun and deepspeed launches.

Every process is started in a session of its own, so that a launcher's workers belong to it too:
a job that outlives its time limit is killed with everything it started and fails the test, and
whatever a test left running is killed when the test run ends. Output is always captured and
shown when a job fails.

Left to the code under test: processes that an API under test starts itself (torch.multiprocessing
in test_multiprocessing, mp.spawn inside child scripts, PyTorch's MultiProcessTestCase in
torch_distributed_driver.py, the os.fork of test_module_surface's fork checks).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Process groups of jobs still running, killed at exit if a test left one behind.
_LIVE_GROUPS: set[int] = set()


def child_env(env: dict | None = None, *, checkout_first: bool = False) -> dict:
    """This process's environment with `env` applied (a value of None unsets the variable).

    With `checkout_first`, this checkout comes first on PYTHONPATH, so that a child imports the
    supa_emu under test even when another copy is installed (it also makes the checkout's
    top-level folders importable, which tests of the installed layout must not have).
    """
    full = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full.pop(name, None)
        else:
            full[name] = str(value)
    if checkout_first:
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full.get("PYTHONPATH")]))
    return full


class Finished:
    """A finished job: its command, return code and captured output."""

    def __init__(self, command, returncode: int, stdout: str, stderr: str):
        self.command = [str(part) for part in command]
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self, tail: int = 6000) -> str:
        return (f"{' '.join(self.command)} exited with {self.returncode}:\n"
                f"stdout:\n{self.stdout[-tail:]}\nstderr:\n{self.stderr[-tail:]}")

    def require_success(self) -> "Finished":
        if self.returncode != 0:
            raise AssertionError(self.describe())
        return self

    def json_lines(self, prefix: str = "") -> list:
        """The JSON values of the stdout lines that start with `prefix` (the prefix removed); with no
        prefix, of the lines that hold a JSON object."""
        if prefix:
            return [json.loads(line[len(prefix):]) for line in self.stdout.splitlines() if line.startswith(prefix)]
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]


def start(command, *, env: dict | None = None, cwd=ROOT, checkout_first: bool = False) -> subprocess.Popen:
    """Starts `command` in a session of its own with its output captured; see `wait`."""
    proc = subprocess.Popen([str(part) for part in command], cwd=cwd, env=child_env(env, checkout_first=checkout_first),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _LIVE_GROUPS.add(proc.pid)
    return proc


def wait(procs: list, timeout: float, what: str = "job") -> list[Finished]:
    """Waits for jobs started together; past `timeout` seconds all of them are killed and the test fails."""
    deadline = time.monotonic() + timeout
    finished = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{what} hung (still running after {timeout:.0f} s): "
                                     + "; ".join(" ".join(map(str, p.args)) for p in procs)) from None
            finished.append(Finished(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            _kill_group(proc)
    return finished


def run(command, *, env: dict | None = None, cwd=ROOT, timeout: float = 300, check: bool = False,
        checkout_first: bool = False) -> Finished:
    """Runs one command to completion (see `start` and `wait`)."""
    [result] = wait([start(command, env=env, cwd=cwd, checkout_first=checkout_first)], timeout)
    return result.require_success() if check else result


def _kill_group(proc: subprocess.Popen) -> None:
    """Kills what is left of the job's session (a launcher's workers outlive their launcher when it is killed)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()
    _LIVE_GROUPS.discard(proc.pid)


@atexit.register
def _kill_leftovers() -> None:
    for group in list(_LIVE_GROUPS):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# ------------------------------------------------------------------------------------------------
# Fresh interpreters
# ------------------------------------------------------------------------------------------------
def run_python(code: str, env: dict | None = None, timeout: float = 300, check: bool = True,
               args=(), cwd=ROOT) -> Finished:
    """Runs `code` in a fresh interpreter (so autoload and environment handling are exercised for real).

    The code is written to a script file rather than passed with -c, so that multiprocessing's
    spawn can re-import __main__.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(textwrap.dedent(code))
    try:
        return run([sys.executable, script.name, *args], env=env, cwd=cwd, timeout=timeout, check=check)
    finally:
        os.unlink(script.name)


def run_scenario(code: str, env: dict | None = None, timeout: float = 300):
    """Runs `code` with run_python and returns what it printed as JSON on a line 'RESULT <json>'."""
    result = run_python(code, env=env, timeout=timeout)
    values = result.json_lines("RESULT ")
    if not values:
        raise AssertionError(f"no RESULT line in the output:\n{result.describe()}")
    return values[-1]


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A loopback port that was free a moment ago (for a rendezvous the test starts next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(script, *args, nproc: int, port: int, nnodes: int = 1, node_rank: int = 0) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--node-rank", node_rank,
            "--nproc-per-node", nproc, "--master-addr", "127.0.0.1", "--master-port", port, script, *args]


def deepspeed_command(script, *args, num_gpus: int, port: int, launcher_args=()) -> list:
    runner = shutil.which("deepspeed")
    prefix = [runner] if runner else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [*prefix, "--num_gpus", num_gpus, "--master_port", port, *launcher_args, script, *args]


def launch(make_command, *, env: dict | None = None, timeout: float = 900) -> Finished:
    """Runs a launcher job `make_command(port)` on a fresh rendezvous port.

    A port is only free when it was picked: another process may take it before the rendezvous
    binds it, so a job that failed on exactly that is started once more on another port.
    """
    result = run(make_command(free_port()), env=env, timeout=timeout)
    if result.returncode != 0 and "address already in use" in result.output.lower():
        result = run(make_command(free_port()), env=env, timeout=timeout)
    return result


# ------------------------------------------------------------------------------------------------
# Rank jobs: one script, one scenario function, `world` processes
# ------------------------------------------------------------------------------------------------
_RANK_RESULT = "RANK-RESULT "


def run_ranks(script: str, scenario: str, world: int = 2, limit_s: float = 240, env: dict | None = None) -> list:
    """Starts `world` ranks of a multi-process scenario; returns each rank's (returncode, outcome, stderr).

    Each rank is `python script scenario rank port` with SUPA_EMULATE=1; the script's `__main__`
    hands over to `serve_rank(globals())`, which runs its `_scenario_<scenario>(rank, port)` and
    prints the JSON outcome that is returned here (None if the rank printed none). A job still
    running after `limit_s` is killed and fails the test.
    """
    port = free_port()
    procs = [start([sys.executable, os.path.abspath(script), scenario, rank, port],
                   env={"SUPA_EMULATE": "1", **(env or {})}, checkout_first=True) for rank in range(world)]
    results = []
    for finished in wait(procs, limit_s, what=f"job {scenario!r} of {os.path.basename(script)}"):
        outcomes = finished.json_lines(_RANK_RESULT)
        results.append((finished.returncode, outcomes[-1] if outcomes else None, finished.stderr))
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
    """Entry point of a rank started by run_ranks: runs the scenario named on the command line."""
    scenario, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    outcome = namespace[f"_scenario_{scenario}"](rank, port)
    print_line(_RANK_RESULT + json.dumps(outcome))
    os._exit(0)  # skip interpreter teardown: peers may already be gone in the failure scenarios
