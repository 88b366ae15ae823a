"""Builds, validates and loads the native core (`supa_emu/csrc`) for the installed torch.

The build happens once per machine and is cached under SUPA_EMU_CACHE_DIR, keyed by a hash
of the sources, the torch build and the Python version, so a new torch or edited sources
give a fresh build. A file lock makes concurrent ranks wait for one builder instead of
compiling the same thing N times; the waiting ranks say whom they wait for.

A finished build is a directory holding the library and, written last and atomically, a
manifest with the library's size and SHA-256. A library is loaded only after it matches its
manifest: loading a damaged shared object can kill the process (SIGBUS, a C++ terminate)
before Python sees an error, so damage must be caught before dlopen. A damaged build is
reported in one line and relinked from the cached object files.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import pathlib
import sys
import time

from supa_emu import cache_trust, native_compile
from supa_emu.config import ConfigError

log = logging.getLogger("supa_emu")

SOURCE_DIR = pathlib.Path(__file__).parent / "csrc"
MODULE_NAME = "supa_emu_C"
MANIFEST = "manifest.json"
_LAYOUT = "3"  # bump when the cache layout changes, so old caches are not misread
WAIT_REPORT_SECONDS = 20  # how often a process waiting for another's build says so


class CacheDirError(ConfigError):
    """SUPA_EMU_CACHE_DIR (or its default) cannot hold the native build."""


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in SOURCE_DIR.rglob("*") if p.suffix in (".cpp", ".h"))


# The sources compile as four translation units. Most of a unit's compile time goes to parsing
# torch's headers, so the runtime and operator files, which share the same ATen and c10 headers,
# compile as one unit (measured: 27 s of CPU as one unit, about 11 s per file apart); the files
# that need far heavier headers (ATen.h for the autocast policies, Python.h and pybind11 for the
# bindings and the GPU trace's Python half) get a unit each so that they compile in parallel with
# it. The bccl backend's files that parse c10d's headers (the bindings parse them anyway) join the
# bindings. A new .cpp file joins "runtime". A precompiled header of the torch headers the units
# share does not pay with four units: GCC spends more CPU writing it than the units save by reading
# it (bench/native_build.py --part pch; docs/measured_figures.md).
_UNIT_FILES = {
    "bindings": ("module.cpp", "aten/shapes_bindings.cpp", "runtime/gpu_trace.cpp", "distributed/all_gather.cpp",
                 "distributed/signature_board.cpp", "distributed/reducer_timer.cpp", "runtime/op_trace_bindings.cpp",
                 "aten/sdp_choice_bindings.cpp"),
    # op_trace.cpp reads RecordFunction's inline accessors, which must see the header as the release
    # libtorch was built (NDEBUG): it defines NDEBUG first, so it leads a unit whose other file uses
    # no RecordFunction internals.
    "autocast": ("runtime/op_trace.cpp", "aten/autocast.cpp"),
    # The profiler's card track parses Kineto's headers with pybind11's; alone, it compiles beside the rest.
    "card_time": ("runtime/card_time_profiler.cpp",),
}


def _units() -> dict[str, list[pathlib.Path]]:
    """{unit name: its source files}, heaviest unit first."""
    files = [p for p in _sources() if p.suffix == ".cpp"]
    named = {name: [SOURCE_DIR / f for f in members] for name, members in _UNIT_FILES.items()}
    claimed = {p for members in named.values() for p in members}
    return {"runtime": [p for p in files if p not in claimed], "autocast": named["autocast"],
            "bindings": named["bindings"], "card_time": named["card_time"]}


def _headers() -> list[pathlib.Path]:
    return [p for p in _sources() if p.suffix == ".h"]


def build_key() -> str:
    digest = hashlib.sha256()
    digest.update(_LAYOUT.encode())
    for path in _sources():
        digest.update(str(path.relative_to(SOURCE_DIR)).encode())
        digest.update(path.read_bytes())
    for part in native_compile.torch_build():
        digest.update(part.encode())
    digest.update(sys.version.encode())
    digest.update(" ".join(native_compile.compile_flags(MODULE_NAME)).encode())
    digest.update(native_compile.compiler().encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- validation

def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def damage(build_dir: pathlib.Path) -> str | None:
    """Why the build in `build_dir` must not be loaded, or None when it matches its manifest.

    'missing' means there is no finished build (never built, or a build that did not finish).
    """
    library, manifest = build_dir / f"{MODULE_NAME}.so", build_dir / MANIFEST
    if not manifest.exists():
        return "missing"
    try:
        recorded = json.loads(manifest.read_text())
        size, checksum = int(recorded["size"]), str(recorded["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"its manifest is unreadable ({error.__class__.__name__})"
    if not library.exists():
        return f"{library.name} is gone"
    actual = library.stat().st_size
    if actual != size:
        return f"{library.name} has {actual} bytes, the build wrote {size}"
    if _sha256(library) != checksum:
        return f"{library.name} does not match the checksum the build recorded"
    return None


def _write_manifest(build_dir: pathlib.Path, objects: list[pathlib.Path]) -> None:
    library = build_dir / f"{MODULE_NAME}.so"
    with open(library, "rb") as f:
        os.fsync(f.fileno())  # the library reaches the disk before the manifest vouches for it
    record = {"size": library.stat().st_size, "sha256": _sha256(library), "torch": native_compile.torch_build()[0],
              "python": sys.version.split()[0], "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              # which files of the shared object cache this library was linked from
              "objects": [obj.name for obj in objects]}
    staged = build_dir / f"{MANIFEST}.{os.getpid()}.partial"
    with open(staged, "w") as f:
        os.fchmod(f.fileno(), 0o644)  # whatever the umask: the loader refuses files others can write
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(staged, build_dir / MANIFEST)


# ---------------------------------------------------------------- loading

def _import_extension(path: pathlib.Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


def load(cache_dir: pathlib.Path, cache_dir_from_env: bool = True):
    """Returns the compiled module, building it first if this machine has no valid build.

    `cache_dir_from_env` says whether SUPA_EMU_CACHE_DIR chose the directory (for error texts).
    Activation calls it once and records the module in `supa_emu.process_state`.
    """
    if MODULE_NAME in sys.modules:  # an extension module is loaded once per process
        return sys.modules[MODULE_NAME]
    return _import_extension(ready_library(cache_dir, cache_dir_from_env))


def ready_library(cache_dir: pathlib.Path, cache_dir_from_env: bool = True) -> pathlib.Path:
    """The path of a valid build of the core in `cache_dir`, built (or relinked) first if there is
    none; CacheDirError, before anything in it is read, if another user could have planted it."""
    root = cache_dir / "native"
    build_dir = root / build_key()
    library = build_dir / f"{MODULE_NAME}.so"
    _check_trust(cache_dir, [root, build_dir, library, build_dir / MANIFEST, root / "objects"], cache_dir_from_env)
    if damage(build_dir) is not None:  # a read-only cache with a good build loads without writing
        _prepare(root, cache_dir, cache_dir_from_env)
        with _BuildLock(root):
            problem = damage(build_dir)  # another process may have finished it while we waited
            if problem is not None:
                objects = [object_file(root / "objects", unit) for unit in _units()]
                _check_trust(cache_dir, [*objects, *(obj.with_suffix(".sha256") for obj in objects)],
                             cache_dir_from_env)
                damaged = problem != "missing"
                if damaged:
                    log.warning("supa_emu: the cached native core in %s is damaged (%s); rebuilding it",
                                build_dir, problem)
                _build(root, build_dir, quiet_relink=damaged)
    return library


def _where(cache_dir: pathlib.Path, from_env: bool) -> str:
    return (f"SUPA_EMU_CACHE_DIR={str(cache_dir)!r}" if from_env
            else f"the default native-build cache {cache_dir} (SUPA_EMU_CACHE_DIR is unset)")


def _check_trust(cache_dir: pathlib.Path, inside: list[pathlib.Path], from_env: bool) -> None:
    """CacheDirError when another user could have planted what would be loaded or linked."""
    found = cache_trust.untrusted(cache_dir, inside)
    if found is not None:
        path, why = found
        raise CacheDirError(f"{_where(cache_dir, from_env)} is not trusted: {path} is {why}; another user could "
                            f"plant the native core every emulated process loads. Remove their write access "
                            f"(chmod go-w) or set SUPA_EMU_CACHE_DIR to a directory only you can write")


def _prepare(root: pathlib.Path, cache_dir: pathlib.Path, from_env: bool) -> None:
    """Creates the cache directory and checks it is writable; CacheDirError otherwise."""
    where = _where(cache_dir, from_env)
    advice = ("set SUPA_EMU_CACHE_DIR to a writable directory (e.g. SUPA_EMU_CACHE_DIR=$HOME/.cache/supa_emu), "
              "or fix the permissions of this one")
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        probe = root / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = {errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.ENOTDIR: "a path component is a file, not a directory",
                  errno.EEXIST: "a path component is a file, not a directory",
                  errno.ENOSPC: "the disk is full"}.get(error.errno, error.strerror or str(error))
        raise CacheDirError(f"{where} cannot hold the native build: {reason}; {advice}") from None


class _BuildLock:
    """An exclusive flock on <root>/build.lock; a waiting process reports whom it waits for."""

    def __init__(self, root: pathlib.Path):
        self.path = root / "build.lock"
        self.status = root / "build.status"

    def __enter__(self):
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._wait()
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()
        return self

    def _wait(self) -> None:
        start = time.monotonic()
        next_report = start
        while True:
            now = time.monotonic()
            if now >= next_report:
                self.file.seek(0)
                holder = self.file.read().strip() or "?"
                try:
                    status = self.status.read_text().strip()
                except OSError:
                    status = ""
                log.warning("supa_emu: waiting for the build in pid %s, %d s%s", holder, now - start,
                            f" (it reports: {status})" if status else "")
                next_report = now + WAIT_REPORT_SECONDS
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                time.sleep(0.5)

    def __exit__(self, *exc):
        self.status.unlink(missing_ok=True)
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _build(root: pathlib.Path, build_dir: pathlib.Path, quiet_relink: bool = False) -> None:
    """Compiles what the object cache lacks, links the library, then writes its manifest.

    A relink takes a second or two; with `quiet_relink` (the caller has already said what it
    does) it prints nothing. Compiling always reports its progress.
    """
    objects_dir = root / "objects"
    objects_dir.mkdir(mode=0o755, exist_ok=True)
    build_dir.mkdir(mode=0o755, exist_ok=True)
    # Until the new manifest is written, this build is unfinished, not damaged.
    (build_dir / MANIFEST).unlink(missing_ok=True)
    flags = native_compile.compile_flags(MODULE_NAME)
    units = []
    for name, files in _units().items():
        obj = object_file(objects_dir, name, files, flags)
        source = files[0] if len(files) == 1 else _unity_source(obj.with_suffix(".cpp"), files)
        label = f"{name} ({len(files)} files)" if len(files) > 1 else f"{name} ({files[0].relative_to(SOURCE_DIR)})"
        units.append((label, source, obj))
    missing = [unit for unit in units if not _object_ok(unit[2])]
    progress = native_compile.Progress(len(missing), root / "build.status")
    if missing:
        progress.say(f"building the native core for torch {native_compile.torch_build()[0]} (once per machine) in {root}: "
                     f"compiling {len(missing)} of {len(units)} units, {native_compile.jobs()} at a time: "
                     f"{', '.join(unit[0] for unit in missing)}")
        native_compile.compile_objects(missing, flags, progress)
        for _, _, obj in missing:
            _record_checksum(obj)
    elif not quiet_relink:
        progress.say(f"building the native core for torch {native_compile.torch_build()[0]} from its cached objects (linking only)")
    objects = [unit[2] for unit in units]
    library = build_dir / f"{MODULE_NAME}.so"
    try:
        native_compile.link(objects, library)
    except native_compile.BuildError:
        if len(missing) == len(units):
            raise  # everything was freshly compiled: the failure is real
        # A reused object may be the damaged part: recompile every unit once, then link again.
        for obj in objects:
            obj.unlink(missing_ok=True)
        progress = native_compile.Progress(len(units), root / "build.status")
        progress.say(f"linking the cached objects failed; recompiling all {len(units)} units of the native core")
        native_compile.compile_objects(units, flags, progress)
        for obj in objects:
            _record_checksum(obj)
        native_compile.link(objects, library)
    _write_manifest(build_dir, objects)
    if progress.total:
        progress.say(f"native core ready ({progress.elapsed()}): {library}")


def object_file(objects_dir: pathlib.Path, unit: str, files: list[pathlib.Path] | None = None,
                flags: list[str] | None = None) -> pathlib.Path:
    """Where the object of `unit` compiled from this checkout's sources lives in the object cache.

    Its key covers the sources' absolute paths (a compiled file records them), so two checkouts
    of the same sources share a finished library (keyed by content alone) but not objects.
    """
    files = _units()[unit] if files is None else files
    flags = native_compile.compile_flags(MODULE_NAME) if flags is None else flags
    return objects_dir / f"{unit}-{native_compile.object_key(files, _headers(), flags)}.o"


def _object_ok(obj: pathlib.Path) -> bool:
    """An object file is reused only if it still matches the checksum recorded when compiled."""
    try:
        return obj.with_suffix(".sha256").read_text().strip() == _sha256(obj)
    except OSError:
        return False


def _record_checksum(obj: pathlib.Path) -> None:
    staged = obj.with_name(f"{obj.name}.{os.getpid()}.partial-sum")
    staged.write_text(_sha256(obj) + "\n")
    staged.chmod(0o644)
    os.replace(staged, obj.with_suffix(".sha256"))


def _unity_source(path: pathlib.Path, files: list[pathlib.Path]) -> pathlib.Path:
    """A generated file that includes `files`, so their shared headers are parsed once."""
    if not path.exists():
        staged = path.with_name(f"{path.name}.{os.getpid()}.partial")
        staged.write_text("// Generated by supa_emu/native.py: one translation unit for these sources.\n" +
                          "".join(f'#include "{f}"\n' for f in files))
        os.replace(staged, path)
    return path
