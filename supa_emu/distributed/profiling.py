"""bccl's collectives in profiler traces, named as c10d names NCCL's (`bccl:all_reduce`, ...; collective.OPERATIONS).

A group of another kind names its ranges after its backend (`gloo:all_reduce` in a planned
rank's gloo groups, as c10d's gloo backend names them).

c10d's own backends open a profiler range when a collective is issued and close it when the
collective completes, on the thread that completes it, so the trace shows the collective as an
asynchronous event (DDP's profiling, torch's tests and trace tools look for these names). bccl
does the same, only while a profiler is recording: the range opens when the collective has been
handed to its transport and closes once gloo completed it, on a closing thread of its own (gloo's callback
runs inline when the work finished before the callback was attached, and would then close the
range on the issuing thread, as if it were synchronous).
"""

import queue
import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def record(backend: str, call, parts: Sequence[dist.Work]) -> None:
    """While a profiler records: the range of collective `call` (collective.Collective) just
    issued on a group of `backend`, closed once every part of it has completed (parts without
    futures, or none: at once)."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return
    opened = torch.ops.profiler._record_function_enter_new(f"{backend}:{call.operation.profiled_as}", None)
    try:
        futures = [part.get_future() for part in parts]
    except RuntimeError:
        futures = []
    if not futures:
        _closer().put(opened)
        return
    torch.futures.collect_all(futures).then(lambda _: _closer().put(opened))


_records: Optional["queue.SimpleQueue[object]"] = None
_records_lock = threading.Lock()


def _closer() -> "queue.SimpleQueue[object]":
    global _records
    with _records_lock:
        if _records is None:
            _records = queue.SimpleQueue()
            threading.Thread(target=_close_forever, args=(_records,), name="bccl-profiling", daemon=True).start()
    return _records


def _close_forever(records: "queue.SimpleQueue[object]") -> None:
    while True:
        torch.ops.profiler._record_function_exit._RecordFunction(records.get())
