"""Interpreters shared by several tests: the functions (or snippets of code) of any test file that need
a fresh interpreter with the same environment run one after the other in one, each with its own stdout
and result, at the stage of the interpreter's life it declares; one that crashes or hangs fails alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback

from processes import calls, jobs

# When in the interpreter's life a snippet runs, and what it may do there:
UNTOUCHED = "untouched"  # first; reads state only (e.g. before init) and leaves the process as it found it
PRISTINE = "pristine"    # right after the UNTOUCHED ones (at most one per interpreter); may change anything
ANY = "any"              # after those; needs no particular state and leaves the process usable
LAST = "last"            # at the end (at most one per interpreter): may crash or hang the interpreter
STAGES = (UNTOUCHED, PRISTINE, ANY, LAST)
_ONE_PER_INTERPRETER = (PRISTINE, LAST)

_CASE_START, _CASE_RESULT = "SHARED-CASE-START ", "SHARED-CASE-RESULT "


def run_cases(cases_path: str) -> None:
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
        calls.report(_CASE_START, name)
        faulthandler.dump_traceback_later(limit, exit=True)
        out, error, value = io.StringIO(), None, None
        try:
            with contextlib.redirect_stdout(out):
                if kind == "call":
                    value = calls.call(*payload)
                else:
                    filename = f"<shared case {name}>"
                    linecache.cache[filename] = (len(payload), None, payload.splitlines(True), filename)
                    exec(compile(payload, filename, "exec"), {"__name__": "__shared_case__"})
        except BaseException:  # reported as this snippet's failure; the next snippets still run
            error = traceback.format_exc()
        faulthandler.cancel_dump_traceback_later()
        sys.stderr.flush()
        calls.report(_CASE_RESULT, {"name": name, "stdout": out.getvalue(), "error": error, "value": value})


class CaseResult(jobs.Finished):
    """What one snippet of a shared interpreter did: its own stdout and error (its traceback, or
    None), with the whole interpreter's stderr and return code (they are not the snippet's alone)."""

    def __init__(self, name: str, stdout: str, error, finished: jobs.Finished, value=None):
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

    def __init__(self, env: dict, entry: str):
        self.env, self.entry = env, entry
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
        remaining = [name for stage in STAGES for name, (s, _, _) in self.cases.items() if s == stage]
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

    def _run_in_one_interpreter(self, names: list) -> jobs.Finished:
        timeout = sum(self.cases[name][2] for name in names) + 60
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as cases_file:
            json.dump([(name, *case, limit) for name in names for _, case, limit in [self.cases[name]]], cases_file)
        # Functions only: a snippet of code may be about what happens before torch is imported.
        functions_only = all(self.cases[name][1][0] == "call" for name in names)
        proc = jobs.start([sys.executable, self.entry, "shared", cases_file.name], env=self.env,
                          torch_first=functions_only)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a hang the driver could not end; its output says which snippet
            jobs.kill(proc)
            out, err = proc.communicate()
            err += f"\n(killed: still running after {timeout:.0f} s)"
        finally:
            jobs.kill(proc)
            os.unlink(cases_file.name)
        return jobs.Finished(proc.args, proc.returncode, out, err)


_SHARED: dict[tuple, list[_SharedInterpreter]] = {}


class SharedCase:
    """A snippet registered with `register`; `result()` runs its interpreter on first use."""

    def __init__(self, name: str, interpreter: _SharedInterpreter):
        self.name, self._interpreter = name, interpreter

    def result(self, check: bool = True) -> CaseResult:
        """The snippet's CaseResult; with `check`, a snippet that raised fails the test with its traceback."""
        result = self._interpreter.result(self.name)
        return result.require_success() if check else result


def register(name: str, case: tuple, env: dict | None, stage: str, timeout: float, entry: str) -> SharedCase:
    """Adds `case` (("call", [source, function, pickled args]) or ("code", text)) to an interpreter of
    its environment that has room for `stage`; `entry` is the script that runs `run_cases`."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: expected one of {STAGES}")
    # Overrides that change nothing (unsetting what is unset, setting what is set) do not make another environment.
    effective = {key: (None if value is None else str(value)) for key, value in (env or {}).items()}
    key = tuple(sorted((k, v) for k, v in effective.items() if os.environ.get(k) != v))
    interpreters = _SHARED.setdefault(key, [])
    for interpreter in interpreters:
        if name in interpreter.cases:
            raise ValueError(f"shared case {name!r} is registered twice")
    room = [interpreter for interpreter in interpreters if interpreter.has_room_for(stage)]
    if not room:
        room = [_SharedInterpreter(dict(key), entry)]
        interpreters.append(room[0])
    room[0].cases[name] = (stage, case, timeout)
    return SharedCase(name, room[0])
