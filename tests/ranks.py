"""Tests in N ranks, the third way of harness.py: a test function's body runs in every rank, as DeepSpeed's
DistributedTest runs a test method (`distributed_test`); the ranks are jobs (processes/jobs.py) forked
from an interpreter that imported torch already, and kept for the next test of the same file."""

from __future__ import annotations

import functools
import inspect
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from processes import calls, jobs, launchers

_POOL_REPORT = "RANK-POOL-REPORT "
_PASSED, _FAILED, _SKIPPED, _EXITED = "passed", "failed", "skipped", "exited"
_AFTER_A_FAILURE_S = 20  # how long the other ranks may take to finish once one rank failed


def distributed_test(world: int = 2, *, backend: str | None = "bccl", limit_s: float = 240, env: dict | None = None):
    """Makes `test(rank, world, **params)`, a module-level function of a test file, a test whose body
    runs in every rank, as DeepSpeed's DistributedTest runs a test method; the pytest test takes the
    body's other parameters (fixtures, parametrize arguments), pickled to the ranks. Each rank asserts
    for itself; a rank that raises, or does not finish within `limit_s` seconds, fails the test with its
    traceback and output; a body that calls pytest.skip skips it.

    Options:
    - `world`: the number of rank processes (SUPA_EMULATE=1, rank r on supa:r).
    - `backend`: the default group the body finds initialised ("bccl"); with None, none, and the body
      may initialise its own from `rank_store()` (a group it leaves initialised is destroyed after it).
    - `env`: variables set for the ranks (a value of None unsets one).
    The ranks are kept for the next test of the same file, `world` and `env` (interpreter and
    rendezvous start-up dominate a small body): keep a file's tests of one kind together. A body that
    fails, or ends a rank with `exit_rank`, gets them replaced.
    """

    def decorate(body):
        signature = inspect.signature(body)

        @functools.wraps(body)
        def test(**params):
            _run_in_ranks(body, world, backend=backend, limit_s=limit_s, env=env, params=params)

        test.__signature__ = signature.replace(parameters=list(signature.parameters.values())[2:])
        test.rank_body = body
        return test

    return decorate


def _run_in_ranks(body, world: int = 2, backend: str | None = "bccl", limit_s: float = 240, env: dict | None = None,
                  params: dict | None = None) -> None:
    """Runs `body(rank, world, **params)` in the ranks of its file, `world` and `env` (see distributed_test)."""
    key = (inspect.getsourcefile(body), world, tuple(sorted((env or {}).items())))
    pool = _POOLS.get(key)
    if pool is None:
        close_rank_pools()  # one set of ranks at a time: a file's tests of one kind run together
        pool = _POOLS[key] = _RankPool(world, env)
    try:
        pool.run(body, backend, params or {}, limit_s)
    finally:
        if not pool.reusable:
            pool.close()


def rank_store():
    """In a rank body (distributed_test): a store of this body's own, shared by its ranks (e.g. for
    init_process_group(store=...), or for a rank to tell another that it is done)."""
    return _BODY_STORE


def exit_rank(code: int = 0) -> None:
    """In a rank body (distributed_test): ends this rank at once with `code`, as a crash would (no
    teardown), as the test means to; its peers go on with the body."""
    _pool_report(_SERIAL, _EXITED, str(code))
    os._exit(code)


def close_rank_pools() -> None:
    """Ends the ranks kept for later bodies (conftest calls it after a test file's last test)."""
    for pool in list(_POOLS.values()):
        pool.close()


_POOLS: dict[tuple, "_RankPool"] = {}


class _RankPool:
    """`world` rank processes that run the bodies they are sent one after the other; the parent
    sends a body to every rank and waits for each rank's report of it."""

    def __init__(self, world: int, env: dict | None):
        self.world, self.env = world, env
        self.serial = 0
        self.reusable = True
        self.reports: queue.Queue = queue.Queue()
        for attempt in range(2):  # a port is only free when it was picked (see launchers.py)
            self._start()
            failure = self._collect(0, 240, "start-up")
            if failure is None:
                return
            retry = attempt == 0 and "address already in use" in failure.lower()
            self.close()
            if not retry:
                raise AssertionError(f"the ranks did not start:\n{failure}")

    def _start(self) -> None:
        port = launchers.free_port()
        self.outputs = [[] for _ in range(self.world)]
        self.errors = [tempfile.TemporaryFile("w+") for _ in range(self.world)]
        self.procs = [jobs.start([sys.executable, __file__, rank, self.world, port],
                                    env={"SUPA_EMULATE": "1", **(self.env or {})}, checkout_first=True,
                                    stdin=subprocess.PIPE, stderr=self.errors[rank], torch_first=True)
                      for rank in range(self.world)]
        self.readers = [threading.Thread(target=self._read, args=(rank, proc), daemon=True)
                        for rank, proc in enumerate(self.procs)]
        for reader in self.readers:
            reader.start()

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith(_POOL_REPORT):
                self.reports.put((rank, json.loads(line[len(_POOL_REPORT):])))
            else:
                self.outputs[rank].append(line)
        self.reports.put((rank, None))

    def run(self, body, backend: str | None, params: dict, limit_s: float) -> None:
        self.serial += 1
        request = json.dumps({"source": inspect.getsourcefile(body), "name": body.__name__, "backend": backend,
                              "params": calls.pickled(params), "serial": self.serial})
        for rank in range(self.world):
            self.outputs[rank].clear()
            self.errors[rank].seek(0, os.SEEK_END)
        for proc in self.procs:
            try:
                proc.stdin.write(request + "\n")
                proc.stdin.flush()
            except BrokenPipeError:  # reported below as a rank that ended
                pass
        failure = self._collect(self.serial, limit_s, body.__name__)
        if failure is not None:
            raise AssertionError(failure)
        if self.skipped:
            import pytest

            pytest.skip(self.skipped)

    def _collect(self, serial: int, limit_s: float, what: str):
        """Waits for every rank's report of `serial`; returns what failed, or None."""
        deadline = time.monotonic() + limit_s
        outcomes: dict[int, dict] = {}
        self.skipped = None
        while len(outcomes) < self.world:
            if any(o["outcome"] == _FAILED for o in outcomes.values()):
                deadline = min(deadline, time.monotonic() + _AFTER_A_FAILURE_S)
            try:
                rank, report = self.reports.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if report is None:
                outcomes.setdefault(rank, {"outcome": _FAILED, "detail": "the rank ended without reporting"})
            elif report["serial"] == serial:
                outcomes[rank] = report
        self.reusable = all(o["outcome"] in (_PASSED, _SKIPPED) for o in outcomes.values()) \
            and len(outcomes) == self.world
        for rank, outcome in outcomes.items():
            if outcome["outcome"] == _EXITED:
                code = self.procs[rank].wait(timeout=60)
                if code != int(outcome["detail"]):
                    outcome.update(outcome=_FAILED, detail=f"exit_rank({outcome['detail']}) exited with {code}")
        failed = {rank: outcome.get("detail") for rank, outcome in outcomes.items() if outcome["outcome"] == _FAILED}
        failed.update({rank: f"still running after {limit_s:.0f} s (or {_AFTER_A_FAILURE_S} s after a peer failed)"
                       for rank in range(self.world) if rank not in outcomes})
        if not failed:
            skips = [o["detail"] for o in outcomes.values() if o["outcome"] == _SKIPPED]
            self.skipped = skips[0] if skips else None
            return None
        self.close()  # a rank may still be inside a collective: its output is complete once it is killed
        for reader in self.readers:
            reader.join(timeout=5)
        return "\n\n".join(f"rank {rank} of {self.world} in {what}: {detail}\n{self._output(rank)}"
                             for rank, detail in sorted(failed.items()))

    def _output(self, rank: int, tail: int = 6000) -> str:
        self.errors[rank].seek(0)
        stderr = self.errors[rank].read()
        return f"stdout:\n{''.join(self.outputs[rank])[-tail:]}\nstderr:\n{stderr[-tail:]}"

    def close(self) -> None:
        for proc in self.procs:
            jobs.kill(proc)
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except (OSError, ValueError):
                    pass
        self.reusable = False
        for key, pool in list(_POOLS.items()):
            if pool is self:
                del _POOLS[key]


# The rank side: one rank of a _RankPool.
_BODY_STORE = None
_SERIAL = 0


def _pool_report(serial: int, outcome: str, detail: str = "") -> None:
    sys.stdout.flush()  # what the body printed comes first
    line = _POOL_REPORT + json.dumps({"serial": serial, "outcome": outcome, "detail": detail}) + "\n"
    os.write(sys.__stdout__.fileno(), line.encode())


def _serve_rank_pool(rank: int, world: int, port: int) -> None:
    """Runs the bodies the parent sends on stdin, in order, reporting each on stdout."""
    global _BODY_STORE, _SERIAL
    import datetime

    import torch
    import torch.distributed as dist

    if torch.accelerator.device_count():
        torch.accelerator.set_device_index(rank % torch.accelerator.device_count())
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    _pool_report(0, _PASSED)
    for line in sys.stdin:
        request = json.loads(line)
        _SERIAL = request["serial"]
        _BODY_STORE = dist.PrefixStore(f"body-{_SERIAL}/", store)
        try:
            module = calls.import_test_file(request["source"])
            params = calls.unpickled(request["params"])
            test = getattr(module, request["name"])
            backend = request["backend"]
            if dist.is_initialized() and dist.get_backend() != backend:
                dist.destroy_process_group()
            if backend and not dist.is_initialized():
                dist.init_process_group(backend, store=dist.PrefixStore(f"group-{_SERIAL}/", store), rank=rank,
                                        world_size=world)
            getattr(test, "rank_body", test)(rank, world, **params)
            report = (_PASSED, "")
        except BaseException as error:  # reported to the parent, which fails the test with it
            import pytest

            if isinstance(error, pytest.skip.Exception):
                report = (_SKIPPED, str(error))
            else:
                report = (_FAILED, traceback.format_exc())
        if report[0] == _FAILED:
            sys.stderr.flush()
            _pool_report(_SERIAL, *report)
            os._exit(1)  # a peer may be waiting in a collective: no teardown
        if not request["backend"] and dist.is_initialized():
            dist.destroy_process_group()
        _pool_report(_SERIAL, *report)
    os._exit(0)


if __name__ == "__main__":
    import ranks  # the module the test files import: rank_store() and exit_rank() read its globals

    ranks._serve_rank_pool(*map(int, sys.argv[1:4]))
