"""Where a test runs what it checks, three ways, one function each (tests/README.md says which to pick):

1. In the test process: the test body itself, with fixtures putting back what it changes. A script a
   user runs as `python script.py` runs here as `__main__` with `run_as_main(argv)`.
2. In a fresh process: `fresh_process(what, *args, ...)`, for a function of the test file, code a
   user types, or a command (a launcher, a console script).
3. In N ranks: `ranks.distributed_test(world, ...)` makes a test whose body runs in every rank.

Every process is started in a session of its own, so that a launcher's workers belong to it too: a job
that outlives its time limit is killed with everything it started and fails the test, and whatever a
test left running is killed when the test run ends. Output is always captured and shown when a job
fails. How: tests/processes/ (jobs, the fork servers, shared interpreters, launcher commands).

Left to the code under test: processes that an API under test starts itself (torch.multiprocessing
in test_multiprocessing, mp.spawn inside functions run in fresh processes, PyTorch's
MultiProcessTestCase in torch_distributed_driver.py, the os.fork of test_module_surface's fork checks).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pathlib
import sys
import tempfile
import textwrap

from processes import calls, jobs, launchers, shared_interpreters
# What the test files use with fresh_process: what it gives back, its stages, launcher commands and ports.
from processes.calls import Returned
from processes.jobs import ROOT, Finished, child_env, wait  # noqa: F401
from processes.launchers import PORT, deepspeed_command, free_port, torchrun_command  # noqa: F401
from processes.shared_interpreters import ANY, LAST, PRISTINE, UNTOUCHED, SharedCase  # noqa: F401


def fresh_process(what, *args, env: dict | None = None, cwd=ROOT, timeout: float = 300, check: bool = True,
                  checkout_first: bool = False, torch_first: bool | None = None, shared: str | None = None,
                  name: str | None = None, wait: bool = True):
    """Runs `what` in a fresh process and returns what it did (a `Finished`: return code, stdout, stderr).

    `what` is one of:
    - a module-level function of a test file: the process imports that file and calls `what(*args)`
      (`args` are pickled to it); the result is a `Returned`, whose `value` is what the function
      returned (it must be JSON); a function that raises exits with 1, its traceback on stderr.
    - a string: Python code, as a user types it (the imports and their order at activation), written
      to a script file (so that multiprocessing's spawn can import it again) run with `args`.
    - a list: a command, run with `args` after it. `PORT` in it becomes a free loopback port; a job
      that failed because another process took that port before its rendezvous bound it runs once
      more on another (torchrun_command and deepspeed_command make launcher commands).

    Options:
    - `env`: variables set for the process (a value of None unsets one); the rest is this process's.
    - `cwd`: its working directory (the checkout). `checkout_first`: the checkout first on PYTHONPATH.
    - `timeout`: seconds before it is killed with all it started, failing the test.
    - `check`: a process that failed (exit code, or the function raised) fails the test with its output.
    - `torch_first`: whether it may have imported torch before it runs `what`, as a fork of an
      interpreter of the same environment that imported it already (0.2-0.5 s instead of 1.5-3 s).
      The default: yes for a function, no for code and commands, whose point may be what happens
      before or during that import. False for a function that sets the environment before it
      imports torch, or a check that compares two interpreters' own starts (the order of
      sys.modules differs: pickle names some torch objects after it, e.g. in Inductor's cache keys).
    - `shared`: a stage of an interpreter's life (UNTOUCHED: reads only, first; PRISTINE: right
      after those, one per interpreter; ANY; LAST: may crash, one per interpreter): a function or
      code runs in an interpreter shared with the others of the same environment, one after the
      other, each with its own stdout and result. Call it at import time; it returns a `SharedCase`
      whose `result()` runs the interpreter with every case registered by then, whichever tests run,
      and gives this case's `CaseResult` (`result(check=False)`: also one that raised). `name` names a
      case of code (by default its file and line). `timeout` is then the case's own time limit.
    - `wait=False`: it starts and the job is returned; `wait([jobs], timeout)` gives what they did.
    """
    if shared is not None:
        return _share(what, args, env, shared, name, timeout)
    script = None
    if callable(what):
        command = [sys.executable, __file__, "call", inspect.getsourcefile(what), what.__name__, calls.pickled(args)]
        torch_first = True if torch_first is None else torch_first
    elif isinstance(what, str):
        if not wait:
            raise ValueError("fresh_process: code runs waited for (wait=False is for functions and commands)")
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as file:
            file.write(textwrap.dedent(what))
        script = file.name
        command = [sys.executable, script, *args]
    else:
        command = [*what, *args]
    start = dict(env=env, cwd=cwd, checkout_first=checkout_first, torch_first=bool(torch_first))
    try:
        if not wait:
            proc = jobs.start(launchers.with_free_port(command), **start)
            proc.returns_value = callable(what)
            return proc
        for attempt in range(2):
            [result] = jobs.wait([jobs.start(launchers.with_free_port(command), **start)], timeout)
            if attempt or not launchers.lost_its_port(command, result.output):
                break
    finally:
        if script is not None:
            os.unlink(script)
    if callable(what):
        result = Returned(result)
    return result.require_success() if check else result


def _share(what, args: tuple, env: dict | None, stage: str, name: str | None, timeout: float) -> SharedCase:
    if callable(what):
        source = inspect.getsourcefile(what)
        name = name or f"{pathlib.Path(source).stem}.{what.__name__}{args if args else ''}"
        case = ("call", [source, what.__name__, calls.pickled(args)])
    elif isinstance(what, str):
        caller = sys._getframe(2)
        name = name or f"{pathlib.Path(caller.f_code.co_filename).stem}:{caller.f_lineno}"
        case = ("code", textwrap.dedent(what))
    else:
        raise ValueError("fresh_process: shared interpreters run functions and code, not commands")
    return shared_interpreters.register(name, case, env, stage, timeout, __file__)


def run_as_main(argv: list) -> None:
    """Runs the script argv[0] as `python *argv` would, in this process: as __main__, with `argv` as its
    sys.argv (put back after). For a test file that a launcher starts in place of a script, to change
    something around it, and for several scripts in one process (script_sequence.py)."""
    import runpy

    kept, sys.argv = sys.argv, [str(arg) for arg in argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = kept


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


if __name__ == "__main__":  # the fresh process of a function, or a shared interpreter
    if sys.argv[1] == "shared":
        shared_interpreters.run_cases(sys.argv[2])
    elif sys.argv[1] == "call":
        calls.call_and_report(*sys.argv[2:5])
