"""The one way tests start processes: fresh interpreters, rank jobs, torchrun and deepspeed launches.

Every process is started in a session of its own, so that a launcher's workers belong to it too:
a job that outlives its time limit is killed with everything it started and fails the test, and
whatever a test left running is killed when the test run ends. Output is always captured and
shown when a job fails.

Left to the code under test: processes that an API under test starts itself (torch.multiprocessing
in test_multiprocessing, mp.spawn inside functions run in fresh interpreters, PyTorch's
MultiProcessTestCase in torch_distributed_driver.py, the os.fork of test_module_surface's fork
checks). Multi-rank tests whose body runs in every rank: ranks.py, on these primitives.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import importlib.util
import inspect
import json
import os
import pathlib
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback

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


def start(command, *, env: dict | None = None, cwd=ROOT, checkout_first: bool = False, stdin=None,
          stderr=subprocess.PIPE, forked: bool = False) -> subprocess.Popen:
    """Starts `command` in a session of its own with its output captured; see `wait`.

    With `forked`, a command `python script ...` whose script begins by importing torch may be
    forked from an interpreter of the same environment that imported it already (fork_server.py).
    """
    command, full_env = [str(part) for part in command], child_env(env, checkout_first=checkout_first)
    server = _FORK_SERVERS.server_for(command, full_env) if forked else None
    if server is not None:
        command = server.client_command(command)
    proc = subprocess.Popen(command, cwd=cwd, env=full_env, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                            text=True, start_new_session=True)
    _LIVE_GROUPS.add(proc.pid)
    if server is not None:
        server.clients.append(proc)
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
            kill(proc)
    return finished


def run(command, *, env: dict | None = None, cwd=ROOT, timeout: float = 300, check: bool = False,
        checkout_first: bool = False) -> Finished:
    """Runs one command to completion (see `start` and `wait`)."""
    [result] = wait([start(command, env=env, cwd=cwd, checkout_first=checkout_first)], timeout)
    return result.require_success() if check else result


def kill(proc: subprocess.Popen) -> None:
    """Kills what is left of the job's session (a launcher's workers outlive their launcher when it is killed)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()
    _LIVE_GROUPS.discard(proc.pid)


class _ForkServer:
    """A fork_server.py process for one environment, and its clients still running (as far as
    idle() last looked)."""

    SCRIPT = pathlib.Path(__file__).with_name("fork_server.py")

    def __init__(self, env: dict):
        self.directory = tempfile.mkdtemp(prefix="supa_emu-fork-server-")
        self.address = os.path.join(self.directory, "socket")
        self.clients: list[subprocess.Popen] = []
        # Bound here, before the server starts: a client started next finds it (and waits in its backlog).
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(self.address)
            listener.listen(64)
            self.proc = subprocess.Popen([sys.executable, self.SCRIPT, "serve", str(listener.fileno())], cwd=ROOT,
                                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, pass_fds=[listener.fileno()],
                                         start_new_session=True)  # ended by close(), at exit at the latest

    def client_command(self, command: list) -> list:
        return fork_client_command(self.address, command)

    def idle(self) -> bool:
        self.clients = [client for client in self.clients if client.poll() is None]
        return not self.clients

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it died already (its clients ran their commands themselves)
            pass
        self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def fork_client_command(address: str, command: list) -> list:
    """What starts `command` (`python ...`) forked by the fork server at `address`, or as itself
    where none answers there."""
    # -I -S: the client needs the standard library only, and starts in a few milliseconds.
    return [sys.executable, "-I", "-S", _ForkServer.SCRIPT, "run", address, json.dumps(command[1:])]


class _ForkServers:
    """This process's fork servers: one for each environment that forked commands ask for a second
    time (a server for a command asked for once would cost what that command's own start does), at
    most LIMIT at a time (each holds an interpreter with torch imported); the least recently used
    idle one makes room."""

    LIMIT = 2
    # Not part of what a child imports torch with: pytest's name of the test, and what torch itself sets
    # in this process once it compiled or profiled, and reads only then, after import (a child still
    # gets them: the client passes its whole environment). With them in the key, one in-process compile
    # would start a second server for the same environment.
    _VOLATILE = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "DISABLE_CUPTI_LAZY_REINIT",
                 "TEARDOWN_CUPTI")

    def __init__(self):
        self.asked: dict[tuple, int] = {}
        self.servers: dict[tuple, _ForkServer] = {}  # least recently used first

    def server_for(self, command: list, env: dict) -> _ForkServer | None:
        if len(command) < 2 or command[0] != sys.executable or command[1].startswith("-"):
            return None  # interpreter options, -m or -c: not a script that can be run in a forked child
        key = tuple(sorted((k, v) for k, v in env.items() if k not in self._VOLATILE))
        self.asked[key] = self.asked.get(key, 0) + 1
        server = self.servers.pop(key, None)
        if server is not None and server.proc.poll() is not None:  # it died: another takes its place
            server.close()
            server = None
        if server is None and self.asked[key] >= 2 and self._make_room():
            server = _ForkServer(dict(key))
        if server is not None:
            self.servers[key] = server
        return server

    def _make_room(self) -> bool:
        if len(self.servers) < self.LIMIT:
            return True
        for key, server in self.servers.items():
            if server.idle():
                server.close()
                del self.servers[key]
                return True
        return False

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


_FORK_SERVERS = _ForkServers()
atexit.register(_FORK_SERVERS.close)


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


_RETURNED = "FUNCTION-RETURNED "


class Returned(Finished):
    """A fresh interpreter that ran a function: its output (less the line that carried the return
    value) and `value`, what the function returned (as JSON gives it back; None if it raised)."""

    def __init__(self, finished: Finished):
        lines = finished.stdout.splitlines(keepends=True)
        values = [json.loads(line[len(_RETURNED):]) for line in lines if line.startswith(_RETURNED)]
        stdout = "".join(line for line in lines if not line.startswith(_RETURNED))
        super().__init__(finished.command, finished.returncode, stdout, finished.stderr)
        self.value = values[-1] if values else None


def run_function(fn, *args, env: dict | None = None, timeout: float = 300, check: bool = True,
                 cwd=ROOT, checkout_first: bool = False, fresh: bool = False) -> Returned:
    """Runs `fn(*args)`, a module-level function of a test file, in a fresh interpreter that imports
    that file first (so autoload and environment handling are exercised for real); a function that
    raises makes the interpreter exit with 1 and its traceback on stderr. `args` are pickled to it;
    what it returns must be JSON. `env`, `cwd` and `checkout_first` as for `run`.

    The interpreter may be forked from one that imported torch already (see `start`); `fresh`
    starts a new one, for a function that changes the environment before it imports torch (which
    activation reads), and for a check that compares what two interpreters' own starts make (in a
    fresh one the test file is imported before torch; the order of sys.modules decides the module
    pickle names some torch objects by, e.g. torch.contiguous_format in Inductor's cache keys).
    """
    [finished] = wait([start_function(fn, *args, env=env, cwd=cwd, checkout_first=checkout_first, fresh=fresh)],
                      timeout)
    result = Returned(finished)
    return result.require_success() if check else result


def start_function(fn, *args, env: dict | None = None, cwd=ROOT, checkout_first: bool = False,
                   fresh: bool = False) -> subprocess.Popen:
    """As run_function, without waiting for it (see `start`; `Returned(...)` of what `wait` gives
    reads its value)."""
    command = [sys.executable, __file__, "call", inspect.getsourcefile(fn), fn.__name__, pickled(args)]
    return start(command, env=env, cwd=cwd, checkout_first=checkout_first, forked=not fresh)


def pickled(value) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def unpickled(text: str):
    return pickle.loads(base64.b64decode(text))


def _call(source: str, name: str, args: str) -> None:
    """The interpreter started by run_function."""
    value = getattr(import_test_file(source), name)(*unpickled(args))
    sys.stdout.flush()
    os.write(sys.__stdout__.fileno(), (_RETURNED + json.dumps(value) + "\n").encode())


# ------------------------------------------------------------------------------------------------
# Shared fresh interpreters: snippets of several tests (of any file) that need a fresh interpreter
# with the same environment run one after the other in one
# ------------------------------------------------------------------------------------------------
# When in the interpreter's life a snippet runs, and what it may do there:
UNTOUCHED = "untouched"  # first; reads state only (e.g. before init) and leaves the process as it found it
PRISTINE = "pristine"    # right after the UNTOUCHED ones (at most one per interpreter); may change anything
ANY = "any"              # after those; needs no particular state and leaves the process usable
LAST = "last"            # at the end (at most one per interpreter): may crash or hang the interpreter
_STAGES = (UNTOUCHED, PRISTINE, ANY, LAST)
_ONE_PER_INTERPRETER = (PRISTINE, LAST)

_CASE_START, _CASE_RESULT = "SHARED-CASE-START ", "SHARED-CASE-RESULT "


def _report(prefix: str, value) -> None:
    sys.stdout.flush()
    os.write(sys.__stdout__.fileno(), (prefix + json.dumps(value) + "\n").encode())


def _run_shared_cases(cases_path: str) -> None:
    """The shared interpreter: runs the snippets of a JSON file in order, each with its own stdout,
    and reports each one's output or traceback on a line of its own (so that a crash loses only the
    snippet it happened in). A snippet past its time limit ends the interpreter with every thread's
    stack on stderr."""
    import contextlib
    import faulthandler
    import io
    import linecache

    with open(cases_path) as cases_file:
        cases = json.load(cases_file)
    for name, kind, payload, limit in cases:
        _report(_CASE_START, name)
        faulthandler.dump_traceback_later(limit, exit=True)
        out, error, value = io.StringIO(), None, None
        try:
            with contextlib.redirect_stdout(out):
                if kind == "call":
                    source, function, args = payload
                    value = getattr(import_test_file(source), function)(*unpickled(args))
                else:
                    filename = f"<shared case {name}>"
                    linecache.cache[filename] = (len(payload), None, payload.splitlines(True), filename)
                    exec(compile(payload, filename, "exec"), {"__name__": "__shared_case__"})
        except BaseException:  # reported as this snippet's failure; the next snippets still run
            error = traceback.format_exc()
        faulthandler.cancel_dump_traceback_later()
        sys.stderr.flush()
        _report(_CASE_RESULT, {"name": name, "stdout": out.getvalue(), "error": error, "value": value})


class CaseResult(Finished):
    """What one snippet of a shared interpreter did: its own stdout and error (its traceback, or
    None), with the whole interpreter's stderr and return code (they are not the snippet's alone)."""

    def __init__(self, name: str, stdout: str, error, finished: Finished, value=None):
        super().__init__(finished.command, finished.returncode, stdout, finished.stderr)
        self.name, self.error, self.finished, self.value = name, error, finished, value

    def describe(self, tail: int = 6000) -> str:
        return (f"shared case {self.name!r} printed:\n{self.stdout[-tail:]}\nerror:\n{self.error}\n"
                f"the interpreter it ran in: {self.finished.describe(tail)}")

    def require_success(self) -> "CaseResult":
        if self.error is not None:
            raise AssertionError(self.describe())
        return self


class _SharedInterpreter:
    """The snippets that will run in one fresh interpreter, and once it ran, what each one did."""

    def __init__(self, env: dict):
        self.env = env
        self.cases: dict[str, tuple[str, tuple, float]] = {}  # name -> (stage, (kind, payload), time limit)
        self.results: dict[str, CaseResult] | None = None

    def has_room_for(self, stage: str) -> bool:
        return self.results is None and not (
            stage in _ONE_PER_INTERPRETER and any(s == stage for s, _, _ in self.cases.values()))

    def result(self, name: str) -> CaseResult:
        if self.results is None:
            self._run()
        return self.results[name]

    def _run(self) -> None:
        """Runs the snippets in stage order; those after one that crashed or hung its interpreter
        run in a fresh one, so that a crash fails its own test only."""
        self.results = {}
        remaining = [name for stage in _STAGES for name, (s, _, _) in self.cases.items() if s == stage]
        while remaining:
            finished = self._run_in_one_interpreter(remaining)
            reported = {value["name"]: value for value in finished.json_lines(_CASE_RESULT)}
            for name in remaining:
                if name in reported:
                    self.results[name] = CaseResult(name, reported[name]["stdout"], reported[name]["error"], finished,
                                                    reported[name]["value"])
            stopped_in = next((name for name in finished.json_lines(_CASE_START) if name not in reported), None)
            if stopped_in is None:  # ended without starting the rest (it did not come up, or exited)
                for name in remaining:
                    if name not in reported:
                        self.results[name] = CaseResult(name, "", "not run: the interpreter ended before it", finished)
                return
            self.results[stopped_in] = CaseResult(stopped_in, "", "the interpreter died or hung in this case", finished)
            remaining = remaining[remaining.index(stopped_in) + 1:]

    def _run_in_one_interpreter(self, names: list) -> Finished:
        timeout = sum(self.cases[name][2] for name in names) + 60
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as cases_file:
            json.dump([(name, *case, limit) for name in names for _, case, limit in [self.cases[name]]], cases_file)
        # Functions only: a snippet of code may be about what happens before torch is imported.
        functions_only = all(self.cases[name][1][0] == "call" for name in names)
        proc = start([sys.executable, __file__, "shared", cases_file.name], env=self.env, forked=functions_only)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a hang the driver could not end; its output says which snippet
            kill(proc)
            out, err = proc.communicate()
            err += f"\n(killed: still running after {timeout:.0f} s)"
        finally:
            kill(proc)
            os.unlink(cases_file.name)
        return Finished(proc.args, proc.returncode, out, err)


_SHARED: dict[tuple, list[_SharedInterpreter]] = {}


class SharedCase:
    """A snippet registered with `shared_case`; `result()` runs its interpreter on first use."""

    def __init__(self, name: str, interpreter: _SharedInterpreter):
        self.name, self._interpreter = name, interpreter

    def result(self, check: bool = True) -> CaseResult:
        """The snippet's CaseResult; with `check`, a snippet that raised fails the test with its traceback."""
        result = self._interpreter.result(self.name)
        return result.require_success() if check else result


def shared_case(name: str, code: str, env: dict | None = None, stage: str = ANY, timeout: float = 300) -> SharedCase:
    """Registers `code` to run in a fresh interpreter shared with the other snippets of the same
    environment (`env` as for run_python), at `stage` of its life; call at import time, before any
    test runs. The snippet sees its own stdout only; its globals are its own. Its interpreter starts
    when a test first asks for a result of it, and runs every snippet registered with it by then.
    Where the code is not the point of the test, prefer a function (`shared_call`).
    """
    return _register(name, ("code", textwrap.dedent(code)), env, stage, timeout)


def shared_call(fn, *args, env: dict | None = None, stage: str = ANY, timeout: float = 300) -> SharedCase:
    """As shared_case, for `fn(*args)`, a module-level function of a test file: the shared interpreter
    imports that file (at the snippet's turn) and calls it; the CaseResult's `value` is what it
    returned (JSON). `args` are pickled to it."""
    name = f"{pathlib.Path(inspect.getsourcefile(fn)).stem}.{fn.__name__}{args if args else ''}"
    return _register(name, ("call", [inspect.getsourcefile(fn), fn.__name__, pickled(args)]), env, stage, timeout)


def _register(name: str, case: tuple, env: dict | None, stage: str, timeout: float) -> SharedCase:
    if stage not in _STAGES:
        raise ValueError(f"stage {stage!r}: expected one of {_STAGES}")
    # Overrides that change nothing (unsetting what is unset, setting what is set) do not make another environment.
    effective = {key: (None if value is None else str(value)) for key, value in (env or {}).items()}
    key = tuple(sorted((k, v) for k, v in effective.items() if os.environ.get(k) != v))
    interpreters = _SHARED.setdefault(key, [])
    for interpreter in interpreters:
        if name in interpreter.cases:
            raise ValueError(f"shared case {name!r} is registered twice")
    room = [interpreter for interpreter in interpreters if interpreter.has_room_for(stage)]
    if not room:
        room = [_SharedInterpreter(dict(key))]
        interpreters.append(room[0])
    room[0].cases[name] = (stage, case, timeout)
    return SharedCase(name, room[0])


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


def run_as_main(argv: list) -> None:
    """Runs the script argv[0] as __main__ with `argv` as its sys.argv: for a test file that a
    launcher starts in place of a script, to change something around it."""
    import runpy

    sys.argv = [str(arg) for arg in argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def print_line(text: str, stream=None) -> None:
    """Writes `text` and its newline to `stream` (stdout) in one system call: ranks that share a pipe
    then never interleave inside each other's lines (print() may write the text and the newline apart)."""
    stream = stream or sys.stdout
    stream.flush()
    os.write(stream.fileno(), (text + "\n").encode())


@contextlib.contextmanager
def cpu_asked_once():
    """Within it, py-cpuinfo answers every question after the first from the first answer.

    DeepSpeed's op builders and its CPU Adam ask py-cpuinfo about the CPU (architecture, SIMD
    width) on every flag list and optimizer, and py-cpuinfo takes a second for each answer (it times
    the clock in a child process). The machine does not change while a test or a job runs."""
    import functools

    import cpuinfo  # DeepSpeed's requirement

    asked = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = functools.cache(asked)
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = asked


def import_test_file(source: str):
    """The test file at `source`, imported (once) under the name pytest gives it (pickled values name it)."""
    name = pathlib.Path(source).stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == source:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, source)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    import harness  # the module the test files import (its globals, not this __main__'s)

    if sys.argv[1] == "shared":
        harness._run_shared_cases(sys.argv[2])
    elif sys.argv[1] == "call":
        harness._call(*sys.argv[2:5])
