"""Runs PyTorch's own device-generic distributed test base (`DistributedTest._DistTestBase`, the
base of torch's test/distributed/test_distributed_spawn.py) and writes one outcome per test.

    python tests/torch_distributed_driver.py --backend nccl --out results.json [test_name ...]
    python tests/torch_distributed_driver.py --backend gloo --write-gloo-table

torch's base reads its configuration from the environment when it is imported (BACKEND,
WORLD_SIZE, TEMP_DIR with a `barrier` directory, INIT_METHOD), and every test starts
WORLD_SIZE rank processes of its own (`MultiProcessTestCase`), which initialise the group and run
the test body. This driver sets that environment, then runs the tests as unittest cases in this
one process. Under SUPA_EMULATE=1 the transfer to supa is on, so 'nccl' is bccl and 'cuda' the
emulated cards; the gloo reference runs with SUPA_EMULATE=0 on CPU tensors.

The ranks are forked from this process rather than spawned (torch's spawn file, `--start-method
spawn` here): a spawned rank re-imports torch and the test base, about 3 s per rank per test,
which made a test ten times slower than the test itself (4 collectives: 15 s spawned, 2 s forked,
measured 2026-11-25). Each test still gets fresh rank processes; this process only imports
torch and the base and never touches a card before forking.
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import unittest

WORLD_SIZE = 2
# A hanging test is cut off after this long (torch's own default is 300 s per test).
PER_TEST_TIMEOUT_S = 120
TESTS_DIR = pathlib.Path(__file__).resolve().parent
GLOO_TABLE = TESTS_DIR / "torch_distributed_gloo.json"
_CLASS_NAME = "TorchDistributedBase"


def configure(backend: str, world_size: int = WORLD_SIZE) -> None:
    """The environment torch's test base reads at import time (see the module docstring)."""
    temp_dir = tempfile.mkdtemp(prefix="torch-dist-base-")
    os.makedirs(os.path.join(temp_dir, "barrier"))
    os.environ.update({
        "BACKEND": backend,
        "WORLD_SIZE": str(world_size),
        "TEMP_DIR": temp_dir,
        "INIT_METHOD": "env://",
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(PER_TEST_TIMEOUT_S),
        # The base builds some expected values as float64 and moves them to the card; SUPA has
        # no float64, and this switch is how SUPA users run such code (it demotes to float32).
        "BRTB_ENABLE_DTYPE_DEMOTION": "1",
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
    })


def _make_test_class():
    import torch

    if os.environ["BACKEND"] == "nccl":
        # The base's decorators ask NCCL's version while its module is imported.
        try:
            torch.cuda.nccl.version()
        except Exception as error:
            raise RuntimeError(
                "torch's distributed test base cannot be imported for BACKEND=nccl: its decorators "
                f"call torch.cuda.nccl.version(), which raised {type(error).__name__}: {error}") from error
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    start_method = os.environ.get("SUPA_TEST_DIST_START_METHOD", "fork")

    class TorchDistributedBase(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(torch.multiprocessing.get_context(start_method).Process)

    # Spawned ranks unpickle the class by module and name (module-level __getattr__ below).
    TorchDistributedBase.__module__ = __name__
    TorchDistributedBase.__qualname__ = _CLASS_NAME
    return TorchDistributedBase


_test_class = None


def __getattr__(name):
    # Built on first use, after configure(): spawned ranks find the class here by name.
    global _test_class
    if name != _CLASS_NAME:
        raise AttributeError(name)
    if _test_class is None:
        _test_class = _make_test_class()
    return _test_class


class _Outcomes(unittest.TextTestResult):
    """Records pass / fail / error / skip, seconds and the skip reason or error text per test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}
        self._started = {}

    def startTest(self, test):
        self._started[test.id()] = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, detail=""):
        seconds = time.monotonic() - self._started.get(test.id(), time.monotonic())
        self.outcomes[test.id().rsplit(".", 1)[-1]] = {
            "outcome": outcome, "seconds": round(seconds, 2), "detail": detail[-4000:]}

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skip", str(reason))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "pass")  # the base's own expectedFailure: behaves as torch says

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", "passed although the base marks it expectedFailure")


def test_names() -> list:
    return unittest.TestLoader().getTestCaseNames(__getattr__(_CLASS_NAME))


def run(names=(), verbosity: int = 1) -> dict:
    """Runs the named tests (all of the base when empty); returns {name: outcome record}."""
    cls = __getattr__(_CLASS_NAME)
    suite = unittest.TestSuite([cls(name) for name in (names or test_names())])
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=verbosity, stream=sys.stderr)
    return runner.run(suite).outcomes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    parser.add_argument("--world-size", type=int, default=WORLD_SIZE)
    parser.add_argument("--start-method", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--out", help="write {test: outcome} as JSON here")
    parser.add_argument("--write-gloo-table", action="store_true",
                        help=f"regenerate {GLOO_TABLE.name} (run with SUPA_EMULATE=0)")
    parser.add_argument("tests", nargs="*", help="test names (default: the whole base)")
    args = parser.parse_args(argv)
    if args.write_gloo_table and (args.backend != "gloo" or os.environ.get("SUPA_EMULATE", "0") != "0"
                                  or args.tests or args.world_size != WORLD_SIZE):
        parser.error("--write-gloo-table records the whole base on gloo with SUPA_EMULATE=0 and the default world size")
    os.environ["SUPA_TEST_DIST_START_METHOD"] = args.start_method
    configure(args.backend, args.world_size)
    started = time.monotonic()
    outcomes = run(args.tests, verbosity=2)
    elapsed = time.monotonic() - started
    counts = {}
    for record in outcomes.values():
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    summary = " ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"torch distributed base, {args.backend}, world size {args.world_size}: {summary} in {elapsed:.0f} s")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(outcomes, indent=1, sort_keys=True))
    if args.write_gloo_table:
        import torch

        table = {
            "torch": torch.__version__,
            "command": "SUPA_EMULATE=0 python tests/torch_distributed_driver.py --backend gloo --write-gloo-table",
            "world_size": args.world_size,
            "passed": sorted(name for name, record in outcomes.items() if record["outcome"] == "pass"),
            "failed": sorted(name for name, record in outcomes.items() if record["outcome"] in ("fail", "error")),
        }
        GLOO_TABLE.write_text(json.dumps(table, indent=1) + "\n")
    return 0 if all(r["outcome"] in ("pass", "skip") for r in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
