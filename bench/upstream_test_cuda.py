"""Run one of PyTorch's own CUDA test files on the emulated cards and summarise the outcome.

Run: python bench/upstream_test_cuda.py --test-file PATH [--timeout S] [--junitxml PATH] [-- PYTEST ARGS]

The file is any of PyTorch's CUDA test files (test/test_cuda.py, test/test_cuda_multigpu.py...):
it is PyTorch's, not this project's, so it is not in this repository: pass its path
(--test-file). Take it from a PyTorch checkout at the tag of the
installed torch, e.g. `git -C pytorch show v2.13.0:test/test_cuda.py > test_cuda.py`;
`python -c "import torch; print(torch.version.git_version)"` names the exact commit. Its helpers
(torch.testing._internal) come with the torch wheel.

The file runs unchanged apart from these adaptations, made to a copy in a temporary directory:
- a name it imports from torch.testing._internal that the installed torch lacks is defined after
  the import instead (a newer test_cuda.py imports TEST_CUDAMALLOCASYNC from common_utils, torch
  2.13's test_cuda.py defined it itself; test_cuda_multigpu.py imports skipIfSandcastle, which
  2.13 lacks: it skips on Meta's CI only); any other missing name stops the run with its name;
- where the file's torchvision import is commented out, so that HAS_TORCHVISION is True whether
  or not torchvision is installed, the import is restored, so test_resnet skips without it.
It runs with SUPA_EMULATE=1 and SUPA_EMU_DEVICE_COUNT=2 (the transfer makes "cuda" the emulated
cards, so TEST_CUDA, TEST_MULTIGPU and TEST_CUDA_GRAPH hold), test classes instantiated for the
cuda device type only (PYTORCH_TESTING_DEVICE_ONLY_FOR=cuda: the CPU copies test the CPU), and
8 GiB cards unless SUPA_EMU_MEMORY is set (the file sizes its large-tensor tests from the card's
memory; at the profile's 32 GiB they write about 12 GB of host memory), with this checkout's
supa_emu first on PYTHONPATH. pytest runs the copy with a configuration of its own (not this
project's addopts or conftest), on one xdist worker so that a test that kills its process costs
that test only; a watchdog ends a test after --timeout seconds the same way. The summary is read
from the JUnit XML report (--junitxml); the stacks of crashed and timed-out tests are written
next to it (NAME.ended.log).
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Names other versions of the test files import from torch.testing._internal that torch 2.13 does
# not have, with an equivalent made of what the file imports itself.
FALLBACKS = {
    # a newer test_cuda.py imports it; torch 2.13's test_cuda.py defined it so
    "TEST_CUDAMALLOCASYNC": 'TEST_CUDA and torch.cuda.get_allocator_backend() == "cudaMallocAsync"',
    # test_cuda_multigpu.py imports it; torch 2.13 keeps only skip_but_pass_in_sandcastle*: skip a
    # test on Meta's Sandcastle CI only, so here never
    "skipIfSandcastle": "lambda reason: unittest.skipIf(torch.testing._internal.common_utils.IS_SANDCASTLE, reason)",
}

# A test's outcomes from mildest to worst; the summary lists them in REPORTED's order.
OUTCOMES = ("passed", "skipped", "xfailed", "errors", "failed", "timeout", "crashed")
REPORTED = ("passed", "failed", "errors", "crashed", "timeout", "skipped", "xfailed")

# Installed in each test process: ends a test that outlives the limit as a crash would (xdist then
# starts a new worker). Each process keeps a file holding the running test's node id, and
# faulthandler writes there what ended it (a timeout or a fatal signal) with the stacks.
WATCHDOG_CONFTEST = '''\
import faulthandler, os, pytest

_log = None

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _log
    if _log is None:
        _log = open(os.path.join(os.environ["UPSTREAM_WATCHDOG_DIR"], f"{os.getpid()}.log"), "w")
        faulthandler.enable(file=_log, all_threads=True)
    _log.seek(0)
    _log.truncate()
    _log.write(item.nodeid + "\\n")
    _log.flush()
    faulthandler.dump_traceback_later(float(os.environ["UPSTREAM_TEST_TIMEOUT"]), exit=True, file=_log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_unconfigure(config):
    if _log is not None:
        _log.close()
'''


def adapt(source: str) -> str:
    """The test file's text with the adaptations the module docstring lists."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []  # (first line, last line, replacement), applied from the bottom up
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.testing._internal")):
            continue
        module = importlib.import_module(node.module)
        missing = [alias.name for alias in node.names if not hasattr(module, alias.name)]
        if not missing:
            continue
        unknown = [name for name in missing if name not in FALLBACKS]
        if unknown:
            raise SystemExit(f"{node.module} of the installed torch lacks {', '.join(unknown)}; "
                             "this runner knows no stand-in for it")
        node.names = [alias for alias in node.names if alias.name not in missing]
        text = ast.unparse(node) + "\n" if node.names else ""
        text += "".join(f"{name} = {FALLBACKS[name]}  # adapted: not in torch {torch_version()}\n"
                        for name in missing)
        span = node.end_lineno - node.lineno + 1  # blank lines keep later line numbers the file's own
        edits.append((node.lineno - 1, node.end_lineno, text + "\n" * max(0, span - text.count("\n"))))
    for first, last, text in sorted(edits, reverse=True):
        lines[first:last] = [text]
    return "".join(lines).replace("    # import torchvision.models  # noqa: F401",
                                  "    import torchvision.models  # noqa: F401")


def torch_version() -> str:
    import torch

    return torch.__version__


def outcomes(junit: pathlib.Path, ended: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(class, test, outcome, one-line message) per test of the JUnit report; a test whose teardown
    also failed has two entries there and one here."""
    worst = {}  # (class, test) -> (rank, outcome, message)
    for case in ET.parse(junit).getroot().iter("testcase"):
        key = (case.get("classname", "").rpartition(".")[2], case.get("name", ""))
        outcome, message = "passed", ""
        for child in case:
            if child.tag not in ("failure", "error", "skipped"):
                continue
            message = (child.get("message") or child.text or "").strip()
            if child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
            elif "crashed while running" in message:
                message = ended.get("::".join(key), "the worker died without a signal report")
                outcome = "timeout" if message.startswith("Timeout") else "crashed"
            else:
                outcome = "failed" if child.tag == "failure" else "errors"
            break
        rank = OUTCOMES.index(outcome)
        if key not in worst or rank > worst[key][0]:
            first_line = next((line for line in message.splitlines() if line.strip()), "")
            worst[key] = (rank, outcome, first_line[:200])
    return [(*key, outcome, message) for key, (_, outcome, message) in worst.items()]


def ended_tests(folder: pathlib.Path, keep: pathlib.Path) -> dict[str, str]:
    """'Class::test' -> what ended its process ("Timeout (0:05:00)!", "Fatal Python error: ..."),
    from the watchdog files of the processes that died; their stacks are appended to `keep`."""
    ended = {}
    for log in sorted(folder.glob("*.log")):
        text = log.read_text(errors="replace")
        lines = text.splitlines()
        reasons = [line for line in lines[1:] if line.startswith(("Timeout (", "Fatal Python error"))]
        if lines and reasons:
            ended[lines[0].split("::", 1)[1]] = reasons[0]
            with keep.open("a") as out:
                out.write(text + "\n")
    return ended


def summarise(rows: list[tuple[str, str, str, str]], seconds: float) -> None:
    counts = collections.Counter(outcome for _, _, outcome, _ in rows)
    print(f"\n{len(rows)} tests in {seconds / 60:.1f} min: "
          + ", ".join(f"{counts[key]} {key}" for key in REPORTED))
    bad = [row for row in rows if row[2] in ("failed", "errors", "crashed", "timeout")]
    by_class = collections.defaultdict(list)
    for cls, name, outcome, message in bad:
        by_class[cls].append((name, outcome, message))
    for cls in sorted(by_class):
        print(f"\n{cls} ({len(by_class[cls])})")
        for name, outcome, message in sorted(by_class[cls]):
            print(f"  {name} [{outcome}] {message}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test-file", type=pathlib.Path, required=True,
                        help="PyTorch's test/test_cuda.py, test/test_cuda_multigpu.py...")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a test may take (300)")
    parser.add_argument("--junitxml", type=pathlib.Path, default=None,
                        help="where the JUnit report goes (./upstream_NAME.xml for the test file NAME.py)")
    parser.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments, e.g. -k test_graph")
    args = parser.parse_args()
    if not args.test_file.is_file():
        parser.error(f"--test-file {args.test_file}: no such file (PyTorch's test/test_cuda.py or another "
                     "of its CUDA test files; the module "
                     "docstring says where to get it)")

    with tempfile.TemporaryDirectory(prefix="upstream_cuda_tests_") as tmp:
        work = pathlib.Path(tmp)
        name = args.test_file.name  # its own name: pytest's node ids and the report's classes keep it
        (work / name).write_text(adapt(args.test_file.read_text()))
        (work / "conftest.py").write_text(WATCHDOG_CONFTEST)
        (work / "pytest.ini").write_text("[pytest]\nmarkers =\n    serial: common_utils.serialTest\n")
        (work / "watchdog").mkdir()
        junit = (args.junitxml or pathlib.Path(f"upstream_{args.test_file.stem}.xml")).resolve()
        env = dict(os.environ, SUPA_EMULATE="1", SUPA_EMU_DEVICE_COUNT="2", BRTB_TRANSFER_SILENCE="1",
                   PYTORCH_TESTING_DEVICE_ONLY_FOR="cuda", UPSTREAM_TEST_TIMEOUT=str(args.timeout),
                   UPSTREAM_WATCHDOG_DIR=str(work / "watchdog"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        env.setdefault("SUPA_EMU_MEMORY", "8GiB")
        command = [sys.executable, "-m", "pytest", name, "-c", "pytest.ini", "--rootdir", tmp,
                   "-p", "no:cacheprovider", "-p", "no:benchmark", "-n", "1", "--max-worker-restart", "100000",
                   f"--junitxml={junit}", "-q", "-rN", "--tb=short", *args.pytest_args]
        print(" ".join(command), flush=True)
        start = time.monotonic()
        code = subprocess.call(command, cwd=tmp, env=env)
        seconds = time.monotonic() - start
        if not junit.is_file():
            print(f"pytest exited {code} without a JUnit report", file=sys.stderr)
            return code or 1
        stacks = junit.with_suffix(".ended.log")
        stacks.unlink(missing_ok=True)
        summarise(outcomes(junit, ended_tests(work / "watchdog", stacks)), seconds)
        if stacks.exists():
            print(f"\nstacks of the crashed and timed-out tests: {stacks}")
    return code


if __name__ == "__main__":
    sys.exit(main())
