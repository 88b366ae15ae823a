"""A module-level function of a test file called in another process: its arguments pickled there, the
test file imported under the name pytest gives it, its JSON return value reported on a line of its own."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import pathlib
import pickle
import sys

from processes.jobs import Finished

RETURNED = "FUNCTION-RETURNED "


class Returned(Finished):
    """A fresh interpreter that ran a function: its output (less the line that carried the return
    value) and `value`, what the function returned (as JSON gives it back; None if it raised)."""

    def __init__(self, finished: Finished):
        lines = finished.stdout.splitlines(keepends=True)
        values = [json.loads(line[len(RETURNED):]) for line in lines if line.startswith(RETURNED)]
        stdout = "".join(line for line in lines if not line.startswith(RETURNED))
        super().__init__(finished.command, finished.returncode, stdout, finished.stderr)
        self.value = values[-1] if values else None


def pickled(value) -> str:
    return base64.b64encode(pickle.dumps(value)).decode()


def unpickled(text: str):
    return pickle.loads(base64.b64decode(text))


def report(prefix: str, value) -> None:
    """Writes `prefix` and `value` as JSON on a line of its own, after what the caller printed."""
    sys.stdout.flush()
    os.write(sys.__stdout__.fileno(), (prefix + json.dumps(value) + "\n").encode())


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


def call(source: str, name: str, args: str):
    """What `name(*args)` of the test file at `source` returns (`args` as `pickled` gives them)."""
    return getattr(import_test_file(source), name)(*unpickled(args))


def call_and_report(source: str, name: str, args: str) -> None:
    """The fresh interpreter of a function: calls it and reports what it returned."""
    report(RETURNED, call(source, name, args))
