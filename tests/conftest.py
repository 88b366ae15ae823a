"""Shared test setup: markers, fixtures and the summary line of child runs (processes: harness.py).

Tests are written against public APIs (torch.supa, get_accelerator()) so that the same
files run on a real card; `emulation_only` marks those that test the emulator itself.
"""

import atexit
import collections
import fcntl
import gc
import os
import pathlib
import sys
import tempfile

import pytest


def _claim_torch_extensions_dir() -> None:
    """Gives this test run a directory for torch's JIT-built host ops (DeepSpeed's cpu_adam & co.).

    torch marks a build in progress with a `lock` file in the op's build directory and makes
    every later build of that op wait for it to go away; a build that was killed leaves it
    behind, and the next run then hangs without a word (seen: a CI run hung on a lock left by
    an interrupted session). The run holds its directory under flock, so a `lock` file found
    there at start-up belongs to no live build and is removed. Concurrent runs take other slots.
    A TORCH_EXTENSIONS_DIR set by the user is left alone.
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    for slot in range(8):
        directory = base / "supa_emu-tests" / f"torch_extensions-{slot}"
        directory.mkdir(parents=True, exist_ok=True)
        holder = open(directory / ".held-by-a-test-run", "a")
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder.close()
            continue
        for stale in directory.glob("*/lock"):
            stale.unlink()
        atexit.register(holder.close)  # the lock lasts as long as this process (its children are done by then)
        os.environ["TORCH_EXTENSIONS_DIR"] = str(directory)
        return
    os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="supa_emu-torch_extensions-")


_claim_torch_extensions_dir()


def _compile_the_checkout_once() -> None:
    """Compiles the checkout's Python files to bytecode before the workers start.

    The suite starts a few hundred fresh interpreters (tests, ranks, launchers, planned ranks), and
    each imports supa_emu, the accelerator and a test file or example. Where PYTHONDONTWRITEBYTECODE
    is set (some CI machines set it), no interpreter keeps what it compiled, so every one compiles
    those files again: about 0.1 s of CPU each. Compiled once here, they read the bytecode instead
    (installed packages have theirs from pip). Where the checkout cannot be written, each
    interpreter compiles as before.
    """
    if not sys.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    root = pathlib.Path(__file__).resolve().parent.parent
    for folder in ("supa_emu", "accelerator", "op_builder", "tests", "examples"):
        compileall.compile_dir(root / folder, quiet=2)


_compile_the_checkout_once()

# The one-time transfer_to_supa banner (and its TorchScript notice) would otherwise land in the
# stderr of every test's subprocess; the tests of the banner itself unset this.
os.environ.setdefault("BRTB_TRANSFER_SILENCE", "1")


def pytest_collectstart(collector):
    # torch is imported (which activates the emulator under SUPA_EMULATE=1, as in user code) before
    # the first test file, in the processes that collect tests: not in xdist's controller, which
    # only hands out files and would make every worker start a second later.
    import torch  # noqa: F401


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    # pytest keeps the test files it rewrote (their asserts, a second or two of every collection)
    # as bytecode beside them, unless PYTHONDONTWRITEBYTECODE is set; as for the rest of the
    # checkout (_compile_the_checkout_once), it keeps them here anyway.
    keep, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    # What collection builds lives for the whole run (pytest_collection_finish collects once and
    # freezes it): the collections that importing it would trigger (1-1.5 s) find nothing to free.
    gc.disable()
    try:
        return (yield)
    finally:
        sys.dont_write_bytecode = keep
        gc.enable()


@pytest.fixture(scope="session", autouse=True)
def _cpu_asked_once():
    """In this process, py-cpuinfo answers once (harness.cpu_asked_once): DeepSpeed asks it twice
    for each op builder's flags, a second each."""
    import harness

    with harness.cpu_asked_once():
        yield


def _emulated() -> bool:
    try:
        from supa_emu import process_state
    except ImportError:
        return False
    return process_state.is_active()


# The test files that take longest, longest first (measured: --junitxml of a whole run, 2 cores). The
# workers take whole files in this order, then the rest by xdist's default (most tests first); a long
# file started last would keep one worker busy after the other ran out of work. The order changes
# nothing but when a file starts. test_op_builders.py is quick once DeepSpeed's host ops are built,
# and builds four of them (3.5 min, one after the other) on a machine that has none yet: third.
# test_torchtitan.py takes 11 min where torchtitan is installed (skipped elsewhere): first. The planner's
# expert-, context-parallel and time files take minutes too (their slow tests, measured one file at a time:
# docs/measured_figures.md); left to the test-count order they started in the second half of the run.
# `python bench/suite_balance.py run.xml` lists each file's share of a run and replays this order.
LONGEST_FIRST = ("test_torchtitan.py", "test_plan_megatron_pipeline.py", "test_plan.py", "test_op_builders.py", "test_plan_pipeline.py",
                 "test_deepspeed_training.py", "test_compile.py", "test_plan_expert_parallel.py", "test_fidelity.py",
                 "test_torch_distributed.py", "test_hf_trainer.py", "test_two_hosts.py", "test_native_build.py",
                 "test_shapes.py", "test_plan_context_parallel.py", "test_activation.py", "test_plan_time.py",
                 "test_sanitizer.py", "test_memcheck.py", "test_bccl.py",
                 "test_bccl_failures.py", "test_transfer.py", "test_core_share.py", "test_c10d_backend.py")


def pytest_collection_modifyitems(config, items):
    position = {name: index for index, name in enumerate(LONGEST_FIRST)}
    by_count = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (position.get(item.path.name, len(position)), -by_count[item.path], str(item.path)))
    # The emulated torch_supa_ext op tests run in a child pytest with SUPA_EMU_EXT=1
    # (test_torch_supa_ext.py::test_ext_suite_in_subprocess, which prints the child's count in
    # this run's summary); here they are deselected, so that the summary's skips are real ones.
    if os.environ.get("SUPA_EMU_EXT") != "1":
        in_child = [item for item in items if "ext_ops" in item.keywords]
        if in_child:
            config.hook.pytest_deselected(items=in_child)
            items[:] = [item for item in items if "ext_ops" not in item.keywords]
    if _emulated():
        return
    skip = pytest.mark.skip(reason="tests the emulator; run with SUPA_EMULATE=1 on a machine without torch_supa")
    for item in items:
        if "emulation_only" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # What collection built (torch, the OpInfo database, parameters) lives for the whole run: out of
    # the collector's reach, a gc.collect() in a test (test_memory, torch.supa.graph) scans only what
    # the tests made, instead of ~450k objects for about a second each time.
    gc.collect()
    gc.freeze()
    _take_this_workers_share_of_the_cores()


def _take_this_workers_share_of_the_cores() -> None:
    """Each xdist worker takes its share of the cores, as supa_emu/core_share.py has the ranks of a
    job do: with PyTorch's default (an OpenMP team as wide as the host in every worker) the workers'
    spinning threads take the cores the other worker and its children need. Children keep PyTorch's
    default (and core_share's), as a user's processes have them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and not os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    last_of_its_file = nextitem is None or nextitem.path != item.path
    if last_of_its_file:  # the ranks of ranks.distributed_test serve the tests of one file
        import ranks

        ranks.close_rank_pools()
    result = yield
    if last_of_its_file and nextitem is not None:
        # As after collection: what a finished file leaves alive (its module, the caches it filled) is
        # moved out of the collector's reach once the file's fixtures are torn down, so that the
        # gc.collect() calls of later files (test_attention, test_memory, torch.supa.graph) scan
        # only their own objects.
        gc.collect()
        gc.freeze()
    return result


_CHILD_RUNS: list[str] = []


@pytest.fixture
def report_child_run():
    """Adds a line (e.g. a child pytest's summary) to this run's terminal summary."""
    return _CHILD_RUNS.append


def pytest_terminal_summary(terminalreporter):
    for line in _CHILD_RUNS:
        terminalreporter.write_line(line)


# The suite runs on pytest-xdist workers, one per usable core, whole test files to a worker
# (`-n auto --dist loadfile` in pyproject.toml): most tests keep one core busy (a test or a
# fresh interpreter), so a second worker uses the second core. `-n 0` runs in one process.
def pytest_xdist_auto_num_workers(config):
    return max(1, len(os.sched_getaffinity(0)))


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its child runs' lines go to the controller's summary
        workeroutput["child_runs"] = list(_CHILD_RUNS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    _CHILD_RUNS.extend(getattr(node, "workeroutput", {}).get("child_runs", ()))


def behaviour_table():
    """A `{name: check}` table and the decorator that fills it (`@check("a", "b")` registers the
    function as the check of both names), for tests that give every name of an API a check."""
    checks = {}

    def check(*names):

        def register(fn):
            for name in names:
                checks[name] = fn
            return fn

        return register

    return checks, check


@pytest.fixture
def supa_initialised():
    """torch.supa initialised before the test (test_graphs*.py use it for every test)."""
    import torch

    torch.supa.init()


@pytest.fixture
def restore_supa_device():
    """Initialises torch.supa and makes the device current before the test current again after it."""
    import torch

    torch.supa.init()
    previous = torch.supa.current_device()
    yield
    torch.supa.set_device(previous)
