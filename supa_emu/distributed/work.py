"""Completion handle of a bccl operation: waits for its transport's parts, then runs its epilogue once.

A bccl operation is the operations its transport started (gloo's, between real ranks; none in a
planned rank) plus, when they could not do the whole job, an epilogue (copy a staged result back,
divide a sum into an average, unpack a packed exchange). `wait()` waits for the parts in the
caller's thread and runs the epilogue there, which keeps a collective's latency at the
transport's own; a future (`get_future()`, used by DDP-style hooks and
by C++ callers through the process-group trampoline) is built only when asked for, chained on the
parts' futures so it completes, epilogue included, without anyone calling wait().

C++ code may hold a work after Python dropped it: DDP's reducer keeps the handle of its forward-pass
all_reduce and, in backward, waits for it and reads its future. pybind11's trampoline finds these
methods only while the Python object lives; without it the call lands in c10d's base
`Work::wait`, which nothing completes, and hangs. So a work dropped before anyone waited for it
or asked for its future keeps itself alive (`__del__`) until one of those happens, among the most
recent `_Orphans.LIMIT` such works (a program that never waits for its async collectives must not
keep their tensors forever).

Whoever must know where the program waits for a collective (the planner's time model: from there
the stream that waits is behind the collective) registers a callback with `when_waited`; it runs
in the waiting thread at each wait() (synchronize() too), and where the future is asked for: a
future's own wait is C++'s (DDP's reducer), which no one here sees.

A transport whose parts need more (the gloo transport checks its peers' signatures and hands its
parts back to gloo's keeper: gloo/work.py) subclasses this handle through its three hooks.
"""

import collections
import datetime
import threading
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from supa_emu.supa import _sanitizer_switch as _sanitizer


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
    ):
        super().__init__()
        self._parts = list(parts)
        self._epilogue = epilogue
        self._outputs = list(outputs)
        # The host views do not own device memory: the device tensors must outlive the parts' use.
        self._keep_alive = keep_alive
        # Re-entrant: a future whose parts already finished runs its callback inline, under the lock.
        self._lock = threading.RLock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None
        self._waited = False
        self._waiters: List[Callable[[], None]] = []

    @property
    def parts(self) -> List[dist.Work]:
        """The transport's operations this work completes with (until it was waited for)."""
        return self._parts

    def __del__(self):
        # Python finalises an object once: a work adopted here is freed for good when released.
        if not getattr(self, "_waited", True) and self._future is None and _orphans is not None:
            _orphans.adopt(self)

    def when_waited(self, callback: Callable[[], None]) -> None:
        """Call `callback` (in the waiting thread) each time this work is waited for (see the module)."""
        self._waiters.append(callback)

    def _tell_waiters(self) -> None:
        for callback in self._waiters:
            callback()

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

    # ---- what a transport's works add (gloo/work.py) ----------------------------------------------
    def _check_peers(self, limit: Optional[datetime.timedelta]) -> Optional[BaseException]:
        """Before the parts are waited for (at most `limit` when given): an error the peers' side
        makes this work's outcome, or None."""
        return None

    def _peers_known(self) -> bool:
        """Whether `_check_peers` would not wait (never waits; records an error it found)."""
        return True

    def _wait_parts(self, limit: Optional[datetime.timedelta]) -> None:
        for part in self._parts:
            if limit is not None:
                part.wait(limit)
            else:
                part.wait()

    def _parts_waited(self) -> None:
        """The parts completed and were waited for: let go of them."""
        self._parts = []

    # ---- c10d's Work -----------------------------------------------------------------------------
    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._waited = True  # an orphan stays adopted: a C++ holder may ask for the future next
        if self._waiters:
            self._tell_waiters()
        if self._done and self._error is not None:
            raise self._error
        # A positive timeout bounds this call's waits, as NCCL's wait(timeout) does; zero means the group's.
        limit = timeout if timeout and timeout > datetime.timedelta(0) else None
        failure = self._check_peers(limit)
        self._wait_parts(limit)
        if failure is not None:
            self._fail(failure)  # the outputs hold what a stand-in sent: not a result
        self._complete()
        self._parts_waited()
        sanitizer = _sanitizer.active()
        if sanitizer is not None:
            sanitizer.work_waited(self)
        return True

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if not self._done:
                self._error, self._done, self._epilogue, self._keep_alive = error, True, None, ()

    def is_completed(self) -> bool:
        if self._done:
            return True
        if all(part.is_completed() for part in self._parts) and self._peers_known():
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
        self._tell_waiters()
        with self._lock:
            if self._future is not None:
                return self._future
            part_futures = _futures_of(self._parts)
            if part_futures is None:
                # Parts without futures (point-to-point ones may have none): complete this one by waiting now.
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
            part_future.value()  # re-raises the error of a failed part
        self._peers_known()  # runs on the transport's thread, which must not wait
        return self._complete()

    def result(self) -> List[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        self.wait()


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
