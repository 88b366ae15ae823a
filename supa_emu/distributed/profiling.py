"""bccl's collectives in profiler traces, named as c10d names NCCL's (`bccl:all_reduce`, ...).

c10d's own backends open a profiler range when a collective is issued and close it when the
collective completes, on the thread that completes it, so the trace shows the collective as an
asynchronous event (DDP's profiling, torch's tests and trace tools look for these names). bccl
does the same, only while a profiler is recording: the range opens when the collective has been
handed to gloo and closes once gloo completed it, on a closing thread of its own (gloo's callback
runs inline when the work finished before the callback was attached, and would then close the
range on the issuing thread, as if it were synchronous).
"""

import queue
import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist

# ProcessGroupBCCL method (or helper) that issued the collective -> the c10d operation name.
_TITLES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "all_gather_single": "_allgather_base",
    "_all_gather_tensors": "_allgather_base",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_tensors": "_reduce_scatter_base",
    "gather": "gather",
    "scatter": "scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
}


def open_range(backend: str, issuer: str) -> Optional[object]:
    """The profiler range of a collective `issuer` just issued, or None when nothing records."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    name = _TITLES.get(issuer, issuer)
    return torch.ops.profiler._record_function_enter_new(f"{backend}:{name}", None)


def close_on_completion(record: object, parts: Sequence[dist.Work]) -> None:
    """Close `record` once every gloo part has completed (parts without futures: now)."""
    try:
        futures = [part.get_future() for part in parts]
    except RuntimeError:
        futures = []
    if not futures:
        _closer().put(record)
        return
    torch.futures.collect_all(futures).then(lambda _: _closer().put(record))


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
