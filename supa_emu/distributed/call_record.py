"""The collectives this process issued on bccl groups, as the planner reports them.

Off unless the planner (`python -m supa_emu.plan`) or SUPA_PLAN_RECORD switches it on; then
every bccl call, real or simulated, is counted here by the one step both process groups share
(ProcessGroupBCCL._finish), so a planned rank and a real one are recorded by the same code.
A call is (op, group size, dtype, bytes): bytes is the larger of what the call reads and what it
writes on this rank (an all_gather_into_tensor counts its output, a reduce_scatter its input),
as collective benchmarks count a message's size. `count` is how many such calls were made.
"""

from typing import Dict, List, Tuple

# c10d method -> the torch.distributed name people know.
OPERATIONS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "reduce": "reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "broadcast": "broadcast",
    "allgather": "all_gather",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "gather": "gather",
    "scatter": "scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
}

# torch.distributed functions whose result depends on what the other ranks hold, not only on
# its shape: under the uniform-rank rule their answer is a guess the report must name.
_VALUE_DEPENDENT_CALLERS = {
    "all_gather_object": "all_gather_object: every rank's object is taken to be this rank's",
    "gather_object": "gather_object: every rank's object is taken to be this rank's",
    "broadcast_object_list": "broadcast_object_list: the root's objects are taken to be this rank's",
    "scatter_object_list": "scatter_object_list: this rank keeps its own objects",
}

_active = False
_calls: Dict[Tuple[str, int, str, int], int] = {}
_notes: Dict[str, int] = {}


def start() -> None:
    global _active
    _active = True


def active() -> bool:
    return _active


def _operation(frame) -> str:
    # _finish is called by the c10d method itself or by its shared helper (_all_gather_tensors...).
    while frame is not None:
        name = frame.f_code.co_name
        if name in OPERATIONS:
            return OPERATIONS[name]
        frame = frame.f_back
    return "unknown"


def note_call(group_size: int, call, caller_frame) -> None:
    """Counts one collective: its host call (tensors and whether each is read/written)."""
    read = written = 0
    dtype = None
    for tensor, (reads, writes) in zip(call.device_tensors, call.access_modes):
        size = tensor.numel() * tensor.element_size()
        read += size if reads else 0
        written += size if writes else 0
        dtype = dtype or str(tensor.dtype).replace("torch.", "")
    key = (_operation(caller_frame), group_size, dtype or "none", max(read, written))
    _calls[key] = _calls.get(key, 0) + 1
    frame = caller_frame
    for _ in range(8):  # the object collectives call the group a few frames up
        if frame is None:
            break
        reason = _VALUE_DEPENDENT_CALLERS.get(frame.f_code.co_name)
        if reason is not None and "distributed_c10d" in frame.f_code.co_filename:
            flag(reason)
            break
        frame = frame.f_back


def flag(reason: str) -> None:
    """Notes a place where the program's path depends on values only the other ranks hold."""
    _notes[reason] = _notes.get(reason, 0) + 1


def counts() -> Dict[Tuple[str, int, str, int], int]:
    """A copy of the call counts by kind, in the order each kind was first made (the planner's
    sections tell what a part of the script called by the difference of two copies)."""
    return dict(_calls)


def collectives(calls: Dict[Tuple[str, int, str, int], int] = None) -> List[dict]:
    """Calls (all so far, or the counts given) in the order each kind was first made:
    [{op, group_size, dtype, bytes, count}]."""
    return [{"op": op, "group_size": size, "dtype": dtype, "bytes": nbytes, "count": count}
            for (op, size, dtype, nbytes), count in (_calls if calls is None else calls).items()]


def value_dependent() -> List[dict]:
    return [{"what": reason, "count": count} for reason, count in _notes.items()]
