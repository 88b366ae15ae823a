"""The allocator's light mutex (supa_emu/csrc/runtime/light_mutex.h), tested in C++.

A card's lock and the block table's shards are this mutex. tests/cpp/light_mutex_test.cpp builds it
alone with the compiler and standard the native core uses, and checks that it excludes (threads
adding to a plain counter lose nothing), that threads sleeping on it are woken (a lost wake-up hangs
the program, which the timeout turns into a failure) and that try_lock sees the holder. A second
build runs the same program under ThreadSanitizer where the compiler has it.
"""

import pathlib
import subprocess

import pytest

import harness
from supa_emu import native, native_compile

TEST_SOURCE = pathlib.Path(__file__).parent / "cpp" / "light_mutex_test.cpp"
RUNTIME = native.SOURCE_DIR / "runtime"
CASES = ("excludes_and_wakes_sleepers", "try_lock_and_unique_lock")


def _build(program, *flags):
    return [native_compile.compiler(), native_compile.CXX_STD, "-O1", "-Wall", "-Wextra", "-Werror", *flags,
            f"-I{RUNTIME}", str(TEST_SOURCE), "-o", str(program), "-pthread"]


def _check_run(program):
    run = harness.fresh_process([program], timeout=60)
    reported = [line for line in run.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert reported == [f"ok {name}" for name in CASES], run.stdout + run.stderr


def test_light_mutex(tmp_path):
    program = tmp_path / "light_mutex_test"
    harness.fresh_process(_build(program), timeout=300)
    _check_run(program)


def test_light_mutex_under_thread_sanitizer(tmp_path):
    program = tmp_path / "light_mutex_test_tsan"
    built = subprocess.run(_build(program, "-fsanitize=thread"), capture_output=True, text=True, timeout=300)
    if built.returncode != 0:
        pytest.skip(f"the compiler has no ThreadSanitizer here: {built.stderr.strip()[-300:]}")
    _check_run(program)
