"""Jobs: processes started in a session of their own with their output captured, waited for together
under one time limit, and killed with everything they started (when they hang, and at exit)."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import signal
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Process groups of jobs still running, killed at exit if a test left one behind.
LIVE_GROUPS: set[int] = set()


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


def start(command, *, env: dict | None = None, cwd=ROOT, checkout_first: bool = False, stdin=None,
          stderr=subprocess.PIPE, torch_first: bool = False) -> subprocess.Popen:
    """Starts `command` in a session of its own with its output captured; see `wait`.

    With `torch_first`, a command `python script ...` whose script begins by importing torch may be
    forked from an interpreter of the same environment that imported it already (forking.py).
    """
    from processes import forking

    command, full_env = [str(part) for part in command], child_env(env, checkout_first=checkout_first)
    server = forking.SERVERS.server_for(command, full_env) if torch_first else None
    if server is not None:
        command = server.client_command(command)
    proc = subprocess.Popen(command, cwd=cwd, env=full_env, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                            text=True, start_new_session=True)
    LIVE_GROUPS.add(proc.pid)
    if server is not None:
        server.clients.append(proc)
    return proc


def wait(procs: list, timeout: float, what: str = "job") -> list[Finished]:
    """Waits for jobs started together; past `timeout` seconds all of them are killed and the test fails.
    A job that ran a function (harness.fresh_process) gives its `Returned`."""
    from processes.calls import Returned

    deadline = time.monotonic() + timeout
    finished = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{what} hung (still running after {timeout:.0f} s): "
                                     + "; ".join(" ".join(map(str, p.args)) for p in procs)) from None
            done = Finished(proc.args, proc.returncode, out, err)
            finished.append(Returned(done) if getattr(proc, "returns_value", False) else done)
    finally:
        for proc in procs:
            kill(proc)
    return finished


def kill(proc: subprocess.Popen) -> None:
    """Kills what is left of the job's session (a launcher's workers outlive their launcher when it is killed)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()
    LIVE_GROUPS.discard(proc.pid)


@atexit.register
def _kill_leftovers() -> None:
    for group in list(LIVE_GROUPS):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
