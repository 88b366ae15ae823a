"""gloo's worker threads never drop the last reference to a work: Python keeps each until gloo is done with it.

A gloo work holds the tensors it was given. The views and buffers bccl hands it are Python
tensors; once Python has let go of one while gloo still holds it, PyTorch moves the Python object
into the C++ tensor, and whichever thread drops the tensor last must take the GIL to free it.
Were that a gloo worker during interpreter shutdown, taking the GIL ends the thread with
`pthread_exit`, whose unwinding through a destructor aborts the process ("terminate called
without an active exception", seen at the end of DeepSpeed jobs). So every gloo work is held here
until gloo's own references are gone, then released by a Python thread; at exit, before the
interpreter starts shutting down, the works still in flight are waited for.
"""

import atexit
import collections
import ctypes
import os
import threading
import time
from typing import Deque, Dict, Iterable

import torch.distributed as dist

from supa_emu import process_state

# Past this many held works, every call scans them all (not just the oldest) for finished ones.
_FULL_SCAN_AT = 256
_EXIT_WAIT_S = 30.0
# How long a waited work's parts may stay with gloo's worker after they completed (it lets go of
# them right after marking them done; past this, they are released later, as any other work).
_RELEASE_WAIT_S = 0.05

_held: Deque[dist.Work] = collections.deque()
# What must live as long as gloo may still use a held work (by id of the work): the device tensors
# behind the host views of a work its caller gave up on (keep_with).
_companions: Dict[int, object] = {}
_lock = threading.Lock()
_exit_hook_installed = False


def hold(works: Iterable[dist.Work]) -> None:
    """Keep `works` (gloo's) until gloo has released them; release those it is done with."""
    global _exit_hook_installed
    with _lock:
        if not _exit_hook_installed:
            atexit.register(_release_all_at_exit)
            _exit_hook_installed = True
        if _held:  # usually empty: waited works were released at their wait
            _release_finished()
        _held.extend(works)


def keep_with(works: Iterable[dist.Work], objects) -> None:
    """Keep `objects` until gloo is done with every one of the held `works` (an abandoned
    collective's tensors: gloo may still write into their memory)."""
    with _lock:
        for work in works:
            if work in _held:
                _companions[id(work)] = objects


def release_finished() -> None:
    """Release the held works gloo is done with (and with them the device memory they kept)."""
    with _lock:
        _release_finished()


def release_now(works: Iterable[dist.Work]) -> None:
    """Release `works` (completed) as soon as gloo's worker has let go of them, and any other finished works.

    Called when a work is waited for, so that the device memory its views keep goes back at that
    point of the program, not whenever a later collective finds gloo done with it: the memory a
    rank peaks at must not depend on thread timing (the planner compares it to the byte).
    """
    use_count = process_state.core()._work_use_count
    deadline = None
    with _lock:
        for work in works:
            if work not in _held:
                continue  # not gloo's (a combined bccl work), or released already
            while use_count(work) > 1:  # 1: Python's (ours, the caller's)
                deadline = deadline or time.monotonic() + _RELEASE_WAIT_S
                if time.monotonic() >= deadline:
                    break
                # The worker lets go microseconds after completing the work: yield to it if it
                # waits for this core. time.sleep(0) would sleep the kernel's timer slack
                # (50 us and more) on every turn, several times per training step.
                os.sched_yield()
            if use_count(work) == 1:
                _held.remove(work)
                _companions.pop(id(work), None)
        if _held:
            _release_finished(use_count)


def _release_finished(use_count=None) -> None:
    # gloo finishes works roughly in order: usually only the oldest need looking at.
    use_count = use_count or process_state.core()._work_use_count
    while _held and use_count(_held[0]) == 1:
        _companions.pop(id(_held.popleft()), None)
    if len(_held) >= _FULL_SCAN_AT:
        still_used = []
        for work in _held:
            if use_count(work) > 1:
                still_used.append(work)
            else:
                _companions.pop(id(work), None)
        _held.clear()
        _held.extend(still_used)


def _release_all_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    with _lock:
        while _held and time.monotonic() < deadline:
            _release_finished()
            if _held:
                time.sleep(0.001)  # gloo's workers finish without the GIL
        # A work that never finished (a peer that hung) is never freed: a gloo thread may still
        # drop it while the interpreter shuts down.
        for work in _held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
        _held.clear()
