"""Compiles and links the native core with progress a person can follow.

One compiler process per translation unit, as many at once as this process may use cores,
in the order given (the caller puts the slowest first). Each object file is stored under a hash of everything that goes into
it (its source, the shared headers, the flags, the torch build), so an edit recompiles only
the units it touched and a damaged library is relinked from the objects in seconds.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import pathlib
import shlex
import subprocess
import sysconfig
import threading
import time

log = logging.getLogger("supa_emu")

# What cpp_extension passes for a CPU extension of this torch (C++20 since torch 2.12), plus -O2.
CXX_STD = "-std=c++20"
OPT_FLAGS = ["-O2"]
HEARTBEAT_SECONDS = 30  # a line at least this often while the compiler works


class BuildError(RuntimeError):
    """The compiler or linker failed; the message carries its output."""


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def jobs() -> int:
    """Compiler processes to run at once: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# torch is imported where it is used, not at module level: importing it autoloads the emulator
# (under SUPA_EMULATE=1), which needs this module and native.py complete.
def torch_build() -> tuple[str, str]:
    """(version, git commit) of the installed torch."""
    import torch

    return torch.__version__, str(torch.version.git_version)


def _torch_dir() -> pathlib.Path:
    import torch

    return pathlib.Path(torch.__file__).parent


def compile_flags(module_name: str) -> list[str]:
    # Kineto's headers include each other by bare name (the profiler's card track reads them).
    includes = [_torch_dir() / "include", _torch_dir() / "include" / "torch" / "csrc" / "api" / "include",
                _torch_dir() / "include" / "kineto", pathlib.Path(sysconfig.get_paths()["include"])]
    flags = [f"-DTORCH_EXTENSION_NAME={module_name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for path in includes:
        flags += ["-isystem", str(path)]
    return flags + ["-fPIC", CXX_STD, *OPT_FLAGS]


def link_flags() -> list[str]:
    return ["-shared", f"-L{_torch_dir() / 'lib'}", "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


def object_key(sources: list[pathlib.Path], headers: list[pathlib.Path], flags: list[str]) -> str:
    """A hash of everything that goes into one object file."""
    digest = hashlib.sha256()
    digest.update(compiler().encode())
    digest.update(" ".join(flags).encode())
    for part in torch_build():
        digest.update(part.encode())
    for path in [*sources, *headers]:
        digest.update(str(path).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class Progress:
    """Prints what is compiled, n of m, and the elapsed time; a heartbeat while nothing finishes."""

    def __init__(self, total: int, status_file: pathlib.Path | None):
        self.total, self.done, self.start = total, 0, time.monotonic()
        self.running: dict[str, float] = {}
        self.status_file = status_file
        self._lock = threading.Lock()
        self._last_line = self.start

    def elapsed(self) -> str:
        return _duration(time.monotonic() - self.start)

    def say(self, message: str) -> None:
        with self._lock:
            self._last_line = time.monotonic()
            log.warning("supa_emu: %s", message)
            if self.status_file is not None:
                try:
                    self.status_file.write_text(message + "\n")
                except OSError:
                    pass  # the status is a courtesy for waiting processes, never a reason to fail

    def started(self, name: str) -> None:
        with self._lock:
            self.running[name] = time.monotonic()

    def finished(self, name: str) -> None:
        with self._lock:
            took = time.monotonic() - self.running.pop(name)
            self.done += 1
            done = self.done
        self.say(f"[{done}/{self.total}] compiled {name} in {_duration(took)} ({self.elapsed()} elapsed)")

    def heartbeat(self) -> None:
        if time.monotonic() - self._last_line >= HEARTBEAT_SECONDS and self.running:
            self.say(f"[{self.done}/{self.total}] still compiling {', '.join(sorted(self.running))} "
                     f"({self.elapsed()} elapsed)")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"{what} failed (exit {result.returncode}):\n$ {shlex.join(command)}\n"
                         f"{result.stdout}{result.stderr}")


def compile_objects(units: list[tuple[str, pathlib.Path, pathlib.Path]], flags: list[str],
                    progress: Progress) -> None:
    """Compiles each (display name, source, object path) whose object is missing, in parallel.

    Objects are written to a temporary name and renamed, so a killed build leaves no partial file.
    """
    def build(unit):
        name, source, obj = unit
        progress.started(name)
        partial = obj.with_name(f"{obj.name}.{os.getpid()}.partial")
        try:
            _run([compiler(), *flags, "-c", str(source), "-o", str(partial)], f"compiling {name}")
            partial.chmod(0o644)  # whatever the umask: the loader refuses files others can write
            os.replace(partial, obj)
        finally:
            partial.unlink(missing_ok=True)
        progress.finished(name)

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs()) as pool:
        pending = {pool.submit(build, unit) for unit in units}
        while pending:
            finished, pending = concurrent.futures.wait(pending, timeout=1.0,
                                                        return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in finished:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()
            progress.heartbeat()


def link(objects: list[pathlib.Path], output: pathlib.Path) -> None:
    """Links the objects into `output` (written under a temporary name, then renamed)."""
    partial = output.with_name(f"{output.name}.{os.getpid()}.partial")
    try:
        _run([compiler(), *map(str, objects), *link_flags(), "-o", str(partial)], "linking the native core")
        partial.chmod(0o755)
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
