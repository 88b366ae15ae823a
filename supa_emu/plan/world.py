"""The planned world of this process: which rank of how many it plays, what the ranks played before broadcast.

The planner's rank process (rank_process.py) plays rank r of an N-rank world in which only this
process exists; the uniform transport (uniform_transport.py), which carries its bccl and gloo
groups, answers every collective from here. A process that was not started as a planned rank
(one the script spawns) is refused a group (`admit`).
"""

import os
from typing import Dict, List, Optional, Sequence

import torch

from supa_emu.plan import call_record
from supa_emu.plan.plan_directory import write_atomically
from supa_emu.plan.plan_error import PlanError

# Set by the planner's rank process (`play`): (rank, world size, pid).
_played: Optional[tuple] = None
_groups_created = 0
_memberships: Dict[tuple, None] = {}  # the global ranks of each group this rank is in, in creation order

# What the first played rank broadcast as a root, for the ranks played after it: a program that
# broadcasts a placeholder from non-roots (DeepSpeed's "same list on every rank" checks) needs
# the root's value, which the uniform rule cannot give. Small tensors only: large broadcasts are
# parameter syncs, where the local value is the right answer.
ROOT_VALUE_LIMIT = 1 << 16
_values_file: Optional[str] = None
_keeps_values = False  # whether this rank is the first played, which keeps the values for the others
_root_values: Dict[tuple, torch.Tensor] = {}
_values_read: Optional[int] = None  # the modification time of the values file when last read
_broadcasts: Dict[str, int] = {}


def play(rank: int, world_size: int, values_file: Optional[str] = None) -> None:
    """Makes this process the one that plays `rank` of a `world_size`-rank world; `values_file`
    holds (or, if absent, receives) the small values the roots of broadcasts sent."""
    global _played, _values_file, _keeps_values
    _played = (rank, world_size, os.getpid())
    _values_file = values_file
    _keeps_values = values_file is not None and not os.path.exists(values_file)
    _load_root_values()


def _load_root_values() -> None:
    """Takes the first rank's values, when its file changed since this rank last read it."""
    global _values_read
    if _values_file is None or _keeps_values or not os.path.exists(_values_file):
        return
    written = os.stat(_values_file).st_mtime_ns
    if written != _values_read:
        _root_values.update(torch.load(_values_file))
        _values_read = written


def admit(group_rank: int, group_size: int, members: Sequence[int]) -> None:
    """Checks that a group this process creates belongs to the planned world (raises PlanError), and
    notes its `members` (global ranks): which ranks a played one stands for is checked against them."""
    global _groups_created
    if _played is None or _played[2] != os.getpid():
        raise PlanError(
            "planner: the script spawns its own ranks (a process it started initialises a process group); "
            "the planner runs one process per rank as a launcher does: run the script without spawning")
    rank, world_size, _ = _played
    if _groups_created == 0 and (group_size, group_rank) != (world_size, rank):
        raise PlanError(
            f"planner: the script asks for rank {group_rank} of {group_size}, "
            f"but this process plays rank {rank} of {world_size}: take rank and world size from the "
            f"environment (RANK, WORLD_SIZE) as under a launcher")
    _groups_created += 1
    _memberships[tuple(members)] = None


def groups_created() -> int:
    return _groups_created


def memberships() -> List[List[int]]:
    """The global ranks of every group this rank is in (each distinct list once)."""
    return [list(members) for members in _memberships]


def root_value(group_name: str, host: torch.Tensor, is_root: bool) -> Optional[torch.Tensor]:
    """What the root of a broadcast of `host` (this rank's tensor, in host memory) sent, for a
    non-root rank where it is known: a small value of the first rank played. None where this
    rank's own value stands: on the root (whose small values are kept for the ranks played
    later), for large tensors, and where the root's value is not known (flagged for the report)."""
    _broadcasts[group_name] = _broadcasts.get(group_name, 0) + 1
    key = (group_name, _broadcasts[group_name], host.dtype, host.numel())
    small = host.numel() * host.element_size() <= ROOT_VALUE_LIMIT
    if is_root:
        if small and _keeps_values:
            _root_values[key] = host.clone()
        return None
    if not small:
        return None  # a large value: every rank holds this rank's
    if key not in _root_values:
        _load_root_values()  # the first rank may run beside this one (pipeline stages) and have saved more
    if key not in _root_values:
        call_record.flag("broadcast: the root's value is not known (its rank was not played first); "
                         "this rank's own value stands in")
    return _root_values.get(key)


def save_root_values() -> None:
    """Keeps this rank's small broadcast values so far for the ranks played later (the first played
    rank only; again whenever it waits for a rank that may start then: see p2p_messages.py)."""
    if _keeps_values:
        write_atomically(_values_file, lambda temporary: torch.save(_root_values, temporary))
