"""The native core is built once per machine for the installed torch, rebuilt when its
sources change, safe to build from several ranks starting at once, validated before it is
loaded, and rebuilt (from its cached objects) when a finished build was damaged.

No test here compiles the whole core: they start from a copy of the build this test process
loaded, so a damaged library costs a relink, not a cold build.
"""

import errno
import json
import os
import pathlib
import shutil
import sys

import pytest

import harness
from supa_emu import config, native

CODE = "import torch; print(torch.ones(2, device='supa').sum().item())"


def test_build_key_follows_the_sources(tmp_path, monkeypatch):
    sources = tmp_path / "csrc"
    shutil.copytree(native.SOURCE_DIR, sources)
    monkeypatch.setattr(native, "SOURCE_DIR", sources)
    key = native.build_key()
    assert key == native.build_key()
    with open(sources / "module.cpp", "a") as f:
        f.write("\n// edited\n")
    assert native.build_key() != key


def test_every_source_file_is_in_exactly_one_unit():
    units = native._units()
    members = [p for files in units.values() for p in files]
    assert sorted(members) == sorted(p for p in native._sources() if p.suffix == ".cpp")
    assert len(members) == len(set(members))


def test_no_source_file_is_longer_than_500_lines():
    lengths = {str(p.relative_to(native.SOURCE_DIR)): len(p.read_text().splitlines()) for p in native._sources()}
    assert {name: n for name, n in lengths.items() if n > 500} == {}


def test_each_runtime_source_includes_its_own_header_first():
    for source in sorted((native.SOURCE_DIR / "runtime").glob("*.cpp")):
        header = source.with_suffix(".h")
        assert header.exists(), f"{source.name} has no {header.name}"
        includes = [line for line in source.read_text().splitlines()
                    if line.startswith("#include") and "Python.h" not in line]
        assert includes[0] == f'#include "{header.name}"', source.name


# ---------------------------------------------------------------- a copy of a good build

def _current_cache() -> pathlib.Path:
    return config.load().cache_dir / "native"


@pytest.fixture(scope="session")
def good_build(tmp_path_factory):
    """A cache dir holding a finished build of this checkout and the objects it was linked from."""
    cache = tmp_path_factory.mktemp("good-build") / "cache"
    source, key = _current_cache(), native.build_key()
    objects = [native.object_file(source / "objects", unit) for unit in native._units()]
    if native.damage(source / key) is None and all(native._object_ok(obj) for obj in objects):
        shutil.copytree(source / key, cache / "native" / key)
        # Only this build's objects: the shared object cache also holds those of other source
        # versions and other checkouts, which a test must not pick up.
        (cache / "native" / "objects").mkdir()
        for obj in objects:
            for companion in obj.parent.glob(f"{obj.stem}.*"):
                shutil.copy2(companion, cache / "native" / "objects" / companion.name)
    else:
        # The library this process loaded was linked in another checkout of the same sources
        # (a finished library is shared by content; objects are keyed by their source paths),
        # so this checkout's objects are not cached yet: build them once for the whole run.
        result = _run(cache)
        assert result.returncode == 0 and result.stdout.strip() == "2.0", result.stderr
    return cache


@pytest.fixture
def seeded_cache(good_build, tmp_path):
    """A private copy of `good_build` that a test may damage."""
    shutil.copytree(good_build, tmp_path / "cache")
    return tmp_path / "cache"


def _start(cache: pathlib.Path, code: str = CODE):
    """A fresh interpreter on the emulated card that builds its core into (or loads it from) `cache`."""
    return harness.fresh_process([sys.executable, "-c", code], env={"SUPA_EMULATE": "1", "SUPA_EMU_CACHE_DIR": cache},
                                 wait=False)


def _run(cache: pathlib.Path, code: str = CODE):
    [result] = harness.wait([_start(cache, code)], timeout=900)
    return result


def _library(cache: pathlib.Path) -> pathlib.Path:
    return cache / "native" / native.build_key() / f"{native.MODULE_NAME}.so"


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _random_bytes(path):
    size = path.stat().st_size
    path.write_bytes(os.urandom(size))


def _empty(path):
    path.write_bytes(b"")


def _garbage_manifest(path):
    (path.parent / native.MANIFEST).write_text("{not json")


DAMAGE = {"truncated": _truncate, "random bytes": _random_bytes, "emptied": _empty,
          "garbage manifest": _garbage_manifest}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damage_is_detected_before_loading(seeded_cache, how):
    build_dir = _library(seeded_cache).parent
    assert native.damage(build_dir) is None
    DAMAGE[how](_library(seeded_cache))
    assert native.damage(build_dir) not in (None, "missing")


@pytest.mark.slow  # relinks the core and starts fresh interpreters
@pytest.mark.emulation_only
@pytest.mark.parametrize("how", ["truncated", "random bytes", "emptied"])
def test_damaged_library_is_reported_once_and_relinked(seeded_cache, how):
    """A truncated, overwritten or emptied core library (which loading would turn into a bus error, a
    C++ terminate or an ImportError) is reported in one line and relinked; `import torch` works."""
    DAMAGE[how](_library(seeded_cache))
    result = _run(seeded_cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2.0"
    # One line says what happened; the relink from the cached objects needs no more.
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert "is damaged (" in result.stderr and "rebuilding it" in result.stderr, result.stderr
    assert native.damage(_library(seeded_cache).parent) is None


@pytest.mark.slow  # relinks the core and starts fresh interpreters
@pytest.mark.emulation_only
def test_unfinished_build_without_manifest_is_finished_then_reused(seeded_cache):
    (_library(seeded_cache).parent / native.MANIFEST).unlink()
    result = _run(seeded_cache)
    assert result.returncode == 0, result.stderr
    assert "is damaged" not in result.stderr and "linking only" in result.stderr
    again = _run(seeded_cache)  # a finished, valid build loads without a word
    assert again.returncode == 0 and again.stdout.strip() == "2.0" and again.stderr == "", again.stderr


@pytest.mark.slow
@pytest.mark.emulation_only
def test_damaged_object_file_is_recompiled_alone(seeded_cache):
    # The unit that compiles fastest (one file; the bindings and the runtime take longer).
    objects = list((seeded_cache / "native" / "objects").glob("card_time-*.o"))
    assert len(objects) == 1, objects
    _random_bytes(objects[0])
    _empty(_library(seeded_cache))
    result = _run(seeded_cache)
    assert result.returncode == 0, result.stderr
    assert "compiling 1 of 4 units" in result.stderr and "[1/1] compiled card_time" in result.stderr, result.stderr


@pytest.mark.emulation_only
@pytest.mark.slow  # several fresh interpreters doing real work
def test_concurrent_ranks_build_once(tmp_path, seeded_cache):
    """Two ranks start on a cache with no finished library: one links, the other waits and says so."""
    shutil.rmtree(_library(seeded_cache).parent)
    ranks = harness.wait([_start(seeded_cache) for _ in range(2)], timeout=900)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.describe() for rank in ranks]
    assert [rank.stdout.strip() for rank in ranks] == ["2.0", "2.0"]
    builds = [line for rank in ranks for line in rank.stderr.splitlines() if line.startswith("supa_emu: building")]
    assert len(builds) == 1, [rank.describe() for rank in ranks]
    # The other rank (if it arrived while the first was linking) said whom it waited for.
    waits = [line for rank in ranks for line in rank.stderr.splitlines() if "waiting for the build" in line]
    assert all(line.startswith("supa_emu: waiting for the build in pid ") for line in waits), waits
    # A later process finds the cached build and does not build again.
    again = _run(seeded_cache)
    assert again.returncode == 0 and "building the native core" not in again.stderr


# ---------------------------------------------------------------- progress and waiting

def _hold_the_build_lock(root: pathlib.Path) -> None:
    """Another process building in `root`: holds its lock for 1.5 s, its pid and progress written."""
    import fcntl
    import time

    with open(root / "build.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write("4242\n")
        lock.flush()
        (root / "build.status").write_text("[1/3] compiled runtime\n")
        print("locked", flush=True)
        time.sleep(1.5)


def test_a_waiting_process_names_the_builder(tmp_path, caplog):
    root = tmp_path / "native"
    root.mkdir()
    holder = harness.fresh_process(_hold_the_build_lock, root, wait=False)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with caplog.at_level("WARNING", logger="supa_emu"), native._BuildLock(root):
            pass
    finally:
        harness.wait([holder], timeout=30, what="the lock holder")
    waits = [r.getMessage() for r in caplog.records if "waiting for the build" in r.getMessage()]
    assert waits and "pid 4242" in waits[0] and "[1/3] compiled runtime" in waits[0]


# ---------------------------------------------------------------- unusable cache directories

def test_cache_dir_under_a_file_names_the_variable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(native.CacheDirError, match=r"SUPA_EMU_CACHE_DIR=.*a-file.*writable directory"):
        native._prepare(blocker / "native", blocker, from_env=True)


def test_read_only_cache_dir_names_the_variable(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    with pytest.raises(native.CacheDirError, match=r"SUPA_EMU_CACHE_DIR=.*read-only file system.*writable"):
        native._prepare(tmp_path / "native", tmp_path, from_env=True)
    with pytest.raises(native.CacheDirError, match=r"SUPA_EMU_CACHE_DIR is unset"):
        native._prepare(tmp_path / "native", tmp_path, from_env=False)


@pytest.mark.emulation_only
def test_unusable_cache_dir_at_import_is_one_clear_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = _run(blocker / "cache")
    assert result.returncode != 0
    first = result.stderr.splitlines()[0]
    assert first.startswith("supa_emu: configuration error: SUPA_EMU_CACHE_DIR="), result.stderr
    assert "writable directory" in first


@pytest.mark.emulation_only
def test_a_good_build_loads_from_a_read_only_cache(seeded_cache):
    """Loading needs no write access: a shared, read-only cache with a good build works."""
    for path in seeded_cache.rglob("*"):
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        result = _run(seeded_cache)
    finally:
        for path in seeded_cache.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert result.returncode == 0 and result.stdout.strip() == "2.0", result.stderr
    assert json.loads((_library(seeded_cache).parent / native.MANIFEST).read_text())["size"] > 0


# ---------------------------------------------------------------- whom the cache trusts

NOBODY = 65534  # a uid other than this process's (tests run as root here, and as users elsewhere)


def _other_uid() -> int:
    return NOBODY if os.geteuid() != NOBODY else 1


def _refused(result, path, found):
    """One configuration line naming the variable, the path and the permission found."""
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("supa_emu:")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("supa_emu: configuration error: SUPA_EMU_CACHE_DIR="), lines
    assert f"{path} is {found}" in lines[0], lines


def _refuses(cache: pathlib.Path, path, found) -> None:
    """What activation does with `cache` before it loads anything from it (native.ready_library),
    in this process: the error that becomes the one configuration line _refused reads."""
    with pytest.raises(native.CacheDirError) as refusal:
        native.ready_library(cache)
    assert str(refusal.value).startswith("SUPA_EMU_CACHE_DIR="), refusal.value
    assert f"{path} is {found}" in str(refusal.value), refusal.value


# (what to weaken, how, the permission the refusal names)
UNTRUSTED = {
    "world-writable cache dir": (lambda cache: cache, 0o777, "writable by group and others (mode 0777"),
    "group-writable build dir": (lambda cache: _library(cache).parent, 0o775, "writable by group (mode 0775"),
    "world-writable library": (lambda cache: _library(cache), 0o757, "writable by others (mode 0757"),
    "group-writable manifest": (lambda cache: _library(cache).parent / native.MANIFEST, 0o664,
                                "writable by group (mode 0664"),
}


# The trust rules are checked in this process (native.ready_library, which activation calls before
# it loads the library); test_nothing_is_built_into_a_refused_cache checks a refusal at `import torch`.
@pytest.mark.emulation_only
@pytest.mark.parametrize("what", list(UNTRUSTED))
def test_a_cache_others_can_write_is_refused_before_loading(seeded_cache, what):
    where, mode, found = UNTRUSTED[what]
    path = where(seeded_cache)
    path.chmod(mode)
    # Planted content must not even be read: the refusal comes before the library is checked or rebuilt.
    library = _library(seeded_cache)
    library.chmod(0o755 if path != library else mode)
    library.write_bytes(b"\x7fELF planted")
    _refuses(seeded_cache, path, found)
    assert library.read_bytes() == b"\x7fELF planted", "the refused cache was rebuilt into"


@pytest.mark.emulation_only
@pytest.mark.parametrize("what", ["cache dir", "library", "manifest", "native dir"])
def test_a_cache_owned_by_another_user_is_refused(seeded_cache, what):
    path = {"cache dir": seeded_cache, "library": _library(seeded_cache),
            "manifest": _library(seeded_cache).parent / native.MANIFEST,
            "native dir": seeded_cache / "native"}[what]
    os.chown(path, _other_uid(), -1)
    _refuses(seeded_cache, path, f"owned by uid {_other_uid()} (this process runs as uid {os.geteuid()})")


@pytest.mark.emulation_only
def test_nothing_is_built_into_a_refused_cache(tmp_path):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    result = _run(cache)
    _refused(result, cache, "writable by group and others (mode 0777")
    assert list(cache.iterdir()) == []


@pytest.mark.emulation_only
def test_an_owned_cache_under_a_sticky_world_writable_dir_is_used(seeded_cache, tmp_path):
    """/tmp-like: others may add entries next to ours but not replace them."""
    shared = tmp_path / "tmp-like"
    shared.mkdir()
    shared.chmod(0o1777)
    shutil.move(str(seeded_cache), shared / "cache")
    manifest = _library(shared / "cache").parent / native.MANIFEST
    built = manifest.read_text()
    assert native.ready_library(shared / "cache") == _library(shared / "cache")
    assert manifest.read_text() == built  # the good build is used as it is, not rebuilt
    shared.chmod(0o777)  # without the sticky bit anyone could rename our cache away
    _refuses(shared / "cache", shared, "writable by group and others (mode 0777")


def test_root_owned_read_only_cache_is_trusted_by_other_users(tmp_path):
    """An image's cache built once by root serves every user; another user's does not."""
    from supa_emu import cache_trust

    library = tmp_path / "lib.so"
    library.write_bytes(b"")
    library.chmod(0o444)
    os.chown(library, 0, -1)
    assert cache_trust.problem(library, euid=1000) is None
    os.chown(library, NOBODY, -1)
    assert cache_trust.problem(library, euid=1000) == "owned by uid 65534 (this process runs as uid 1000), mode 0444"
    assert cache_trust.problem(library, euid=NOBODY) is None
    library.chmod(0o666)
    assert "writable by group and others" in cache_trust.problem(library, euid=NOBODY)


def test_a_fresh_build_writes_nothing_others_can_write(tmp_path, good_build):
    """Whatever the umask, what the build writes passes the trust check of the next process."""
    cache = tmp_path / "cache"
    shutil.copytree(good_build, cache)
    shutil.rmtree(_library(cache).parent)
    result = _run(cache, f"import os; os.umask(0); {CODE}")
    assert result.returncode == 0 and result.stdout.strip() == "2.0", result.stderr
    for path in [_library(cache), _library(cache).parent / native.MANIFEST, _library(cache).parent]:
        assert os.stat(path).st_mode & 0o022 == 0, (path, oct(os.stat(path).st_mode))
