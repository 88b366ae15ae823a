"""Completion handle of a bccl operation: waits for its gloo parts, then runs its epilogue once.

A bccl operation is one or more gloo operations on host views plus, when gloo could not do the
whole job, an epilogue (copy a staged result back, divide a sum into an average, unpack a packed
exchange). `wait()` waits for the parts in the caller's thread and runs the epilogue there, which
keeps a collective's latency at gloo's own; a future (`get_future()`, used by DDP-style hooks and
by C++ callers through the process-group trampoline) is built only when asked for, chained on the
parts' futures so it completes, epilogue included, without anyone calling wait().

C++ code may hold a work after Python dropped it: DDP's reducer keeps the handle of its forward-pass
all_reduce and, in backward, waits for it and reads its future. pybind11's trampoline finds these
methods only while the Python object lives; without it the call lands in c10d's base
`Work::wait`, which nothing completes, and hangs. So a work dropped before anyone waited for it
or asked for its future keeps itself alive (`__del__`) until one of those happens, among the most
recent `_Orphans.LIMIT` such works (a program that never waits for its async collectives must not
keep their tensors forever).
"""

import collections
import datetime
import threading
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from supa_emu.supa import _sanitizer_switch as _sanitizer

from . import gloo_handoff


class _Orphans:
    """Works whose Python handle was dropped before anyone waited for them, oldest first."""

    LIMIT = 256

    def __init__(self):
        self._works: "collections.OrderedDict[int, BCCLWork]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def adopt(self, work: "BCCLWork") -> None:
        with self._lock:
            self._works[id(work)] = work
            while len(self._works) > self.LIMIT:
                self._works.popitem(last=False)

    def release(self, work: "BCCLWork") -> None:
        with self._lock:
            self._works.pop(id(work), None)


_orphans = _Orphans()


class BCCLWork(dist.Work):
    def __init__(
        self,
        parts: Sequence[dist.Work],
        epilogue: Optional[Callable[[], None]] = None,
        outputs: Sequence[torch.Tensor] = (),
        keep_alive: Sequence[object] = (),
        agreement=None,
        ticket=None,
    ):
        super().__init__()
        # A collective that started before every peer had posted its signature (see
        # signatures.Agreement) is checked against them here, before and after waiting for gloo.
        self._agreement, self._ticket = agreement, ticket
        self._parts = list(parts)
        self._keeps_parts = False  # True: a recv from any source, whose gloo part knows the sender
        self._epilogue = epilogue
        self._outputs = list(outputs)
        # The host views do not own device memory: the device tensors must outlive gloo's use.
        self._keep_alive = keep_alive
        # Re-entrant: a future whose parts already finished runs its callback inline, under the lock.
        self._lock = threading.RLock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None
        self._waited = False

    @property
    def parts(self) -> List[dist.Work]:
        """The transport's operations this work completes with (until it was waited for)."""
        return self._parts

    def __del__(self):
        # Python finalises an object once: a work adopted here is freed for good when released.
        if not getattr(self, "_waited", True) and self._future is None and _orphans is not None:
            _orphans.adopt(self)

    def _complete(self) -> List[torch.Tensor]:
        """Run the epilogue once all parts have finished; later calls report the same outcome."""
        with self._lock:
            if not self._done:
                try:
                    if self._epilogue is not None:
                        self._epilogue()
                except Exception as error:
                    self._error = error
                finally:
                    self._done, self._epilogue, self._keep_alive = True, None, ()
        if self._error is not None:
            raise self._error
        return self._outputs

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._waited = True  # an orphan stays adopted: a C++ holder may ask for the future next
        # The peers' signatures first: a dead or stalled peer is reported as such, not as gloo's hang.
        # A positive timeout bounds this call's waits, as NCCL's wait(timeout) does; zero means the group's.
        limit = timeout if timeout and timeout > datetime.timedelta(0) else None
        mismatch = self._agreement.settle(self._ticket, limit) if self._ticket is not None else None
        try:
            for part in self._parts:
                if limit is not None:
                    part.wait(limit)
                else:
                    part.wait()
        except RuntimeError as error:
            if isinstance(error, dist.DistError):
                raise
            # gloo reports a timed-out or broken connection as a plain RuntimeError; NCCL (and so
            # code written for it) raises DistBackendError.
            raise dist.DistBackendError(f"bccl: {error}") from error
        if mismatch is not None:
            self._fail(mismatch)  # the outputs hold what a stand-in sent: not a result
        self._complete()
        if self._keeps_parts:
            gloo_handoff.release_finished()
        else:
            # The parts are done: the device memory their views keep goes back now, at this point
            # of the program, rather than when gloo, a later collective or this handle lets go.
            parts, self._parts = self._parts, []
            gloo_handoff.release_now(parts)
        sanitizer = _sanitizer.active()
        if sanitizer is not None:
            sanitizer.work_waited(self)
        return True

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._done:
                self._error, self._done, self._epilogue, self._keep_alive = error, True, None, ()

    def _mismatch_known(self) -> bool:
        """Whether the agreement check is settled (never waits); records a mismatch it found."""
        if self._ticket is None:
            return True
        known, mismatch = self._agreement.settled_error(self._ticket)
        if mismatch is not None:
            self._fail(mismatch)
        return known

    def is_completed(self) -> bool:
        if self._done:
            return True
        if all(part.is_completed() for part in self._parts) and self._mismatch_known():
            if self.exception() is None:
                try:
                    self._complete()
                except Exception:
                    pass  # reported by exception() and wait()
            return True
        return False

    def is_success(self) -> bool:
        if not self.is_completed():
            raise RuntimeError("bccl: is_success() called on a work that has not completed")
        return self.exception() is None

    def exception(self):
        if self._error is not None:
            return self._error
        for part in self._parts:
            if part.is_completed():
                error = part.exception()
                if error is not None:
                    return error
        return None

    def get_future(self) -> torch.futures.Future:
        # From here the future's callback holds this work until it completes.
        _orphans.release(self)
        with self._lock:
            if self._future is not None:
                return self._future
            part_futures = _futures_of(self._parts)
            if part_futures is None:
                # gloo's send/recv offer no future: complete this one by waiting now.
                self._future = torch.futures.Future()
                waited = self._future
            else:
                self._future = torch.futures.collect_all(part_futures).then(self._after_parts)
                return self._future
        try:
            self.wait()
            waited.set_result(self._outputs)
        except Exception as error:
            waited.set_exception(error)
        return waited

    def _after_parts(self, gathered) -> List[torch.Tensor]:
        for part_future in gathered.value():
            part_future.value()  # re-raises the gloo error of a failed part
        # Runs on a gloo thread, which must not wait for the board. Once gloo finished, every peer
        # has posted (it posts before it sends), except under a broadcast root: then wait() checks.
        self._mismatch_known()
        return self._complete()

    def result(self) -> List[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        # Only meaningful for recv from any source, which is a single gloo part.
        return self._parts[0]._source_rank()

    def source_rank(self) -> int:
        return self._source_rank()


def _futures_of(parts: Sequence[dist.Work]) -> Optional[List[torch.futures.Future]]:
    futures = []
    for part in parts:
        try:
            futures.append(part.get_future())
        except RuntimeError:
            return None
    return futures


def combine(works: Sequence[BCCLWork]) -> BCCLWork:
    """One handle that completes when all of `works` have (their epilogues included)."""
    return BCCLWork([work for work in works if work is not None])
