"""The collectives this process issued on bccl groups, and where a planned rank's path depends on others' values.

The record (rank_record.py) counts every bccl call, real or planned, from the record the group
hands its transport (supa_emu.distributed.collective), so a planned rank and a real one are
counted by the same code. A call is (op, group size, dtype, bytes): bytes is the larger of what
the call reads and what it writes on this rank (an all_gather_into_tensor counts its output, a
reduce_scatter its input), as collective benchmarks count a message's size. `count` is how many
such calls were made.
"""

import functools
from typing import Dict, List, Tuple

# torch.distributed functions whose result depends on what the other ranks hold, not only on
# its shape: under the uniform-rank rule their answer is a guess the report must name.
_OBJECT_COLLECTIVES = {
    "all_gather_object": "all_gather_object: every rank's object is taken to be this rank's",
    "gather_object": "gather_object: every rank's object is taken to be this rank's",
    "broadcast_object_list": "broadcast_object_list: the root's objects are taken to be this rank's",
    "scatter_object_list": "scatter_object_list: this rank keeps its own objects",
}

_calls: Dict[Tuple[str, int, str, int], int] = {}
_notes: Dict[str, int] = {}


def note_call(group_size: int, call) -> None:
    """Counts one collective from its record."""
    read = written = 0
    dtype = None
    for tensor, reads, writes in call.accesses():
        size = tensor.numel() * tensor.element_size()
        read += size if reads else 0
        written += size if writes else 0
        dtype = dtype or str(tensor.dtype).replace("torch.", "")
    key = (call.op, group_size, dtype or "none", max(read, written))
    _calls[key] = _calls.get(key, 0) + 1


def flag(reason: str) -> None:
    """Notes a place where the program's path depends on values only the other ranks hold."""
    _notes[reason] = _notes.get(reason, 0) + 1


def flag_object_collectives() -> None:
    """Each call of torch.distributed's object collectives is flagged from now on, in this process
    (a planned rank's; a monkeypatch, listed in docs/pytorch_patches.md, "Patches in Python")."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    for name, reason in _OBJECT_COLLECTIVES.items():
        original = getattr(distributed_c10d, name)

        @functools.wraps(original)
        def flagged(*args, _original=original, _reason=reason, **kwargs):
            flag(_reason)
            return _original(*args, **kwargs)

        setattr(distributed_c10d, name, flagged)
        setattr(dist, name, flagged)


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
