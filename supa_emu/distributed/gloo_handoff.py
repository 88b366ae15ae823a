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
import threading
import time
from typing import Deque, Iterable

import torch.distributed as dist

from supa_emu.supa import _native

# Past this many held works, every call scans them all (not just the oldest) for finished ones.
_FULL_SCAN_AT = 256
_EXIT_WAIT_S = 30.0

_held: Deque[dist.Work] = collections.deque()
_lock = threading.Lock()
_exit_hook_installed = False


def hold(works: Iterable[dist.Work]) -> None:
    """Keep `works` (gloo's) until gloo has released them; release those it is done with."""
    global _exit_hook_installed
    with _lock:
        if not _exit_hook_installed:
            atexit.register(_release_all_at_exit)
            _exit_hook_installed = True
        _release_finished()
        _held.extend(works)


def release_finished() -> None:
    """Release the held works gloo is done with (and with them the device memory they kept)."""
    with _lock:
        _release_finished()


def _release_finished() -> None:
    # gloo finishes works roughly in order: usually only the oldest need looking at.
    use_count = _native()._work_use_count
    while _held and use_count(_held[0]) == 1:
        _held.popleft()
    if len(_held) >= _FULL_SCAN_AT:
        still_used = [work for work in _held if use_count(work) > 1]
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
