"""The planned world of this process: which rank of how many it plays, what the ranks played before broadcast.

The planner's rank process (rank_process.py) plays rank r of an N-rank world in which only this
process exists; the uniform transport (uniform_transport.py), which carries its bccl and gloo
groups, answers every collective from here. A process that was not started as a planned rank
(one the script spawns) is refused a group (`admit`).
"""

import os
from typing import Dict, Optional

import torch

from supa_emu.plan import call_record

# Set by the planner's rank process (`play`): (rank, world size, pid).
_played: Optional[tuple] = None
_groups_created = 0

# What the first played rank broadcast as a root, for the ranks played after it: a program that
# broadcasts a placeholder from non-roots (DeepSpeed's "same list on every rank" checks) needs
# the root's value, which the uniform rule cannot give. Small tensors only: large broadcasts are
# parameter syncs, where the local value is the right answer.
ROOT_VALUE_LIMIT = 1 << 16
_values_file: Optional[str] = None
_root_values: Dict[tuple, torch.Tensor] = {}
_broadcasts: Dict[str, int] = {}


class PlanError(RuntimeError):
    """The script asks for something a planned world cannot give (one line, naming the problem)."""


def play(rank: int, world_size: int, values_file: Optional[str] = None) -> None:
    """Makes this process the one that plays `rank` of a `world_size`-rank world; `values_file`
    holds (or, if absent, receives) the small values the roots of broadcasts sent."""
    global _played, _values_file
    _played = (rank, world_size, os.getpid())
    _values_file = values_file
    if values_file is not None and os.path.exists(values_file):
        _root_values.update(torch.load(values_file))


def admit(group_rank: int, group_size: int) -> None:
    """Checks that a group this process creates belongs to the planned world (raises PlanError)."""
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


def groups_created() -> int:
    return _groups_created


def root_value(group_name: str, host: torch.Tensor, is_root: bool) -> Optional[torch.Tensor]:
    """What the root of a broadcast of `host` (this rank's tensor, in host memory) sent, for a
    non-root rank where it is known: a small value of the first rank played. None where this
    rank's own value stands: on the root (whose small values are kept for the ranks played
    later), for large tensors, and where the root's value is not known (flagged for the report)."""
    _broadcasts[group_name] = _broadcasts.get(group_name, 0) + 1
    key = (group_name, _broadcasts[group_name], host.dtype, host.numel())
    small = host.numel() * host.element_size() <= ROOT_VALUE_LIMIT
    if is_root:
        if small and _values_file is not None and not os.path.exists(_values_file):
            _root_values[key] = host.clone()
        return None
    if not small:
        return None  # a large value: every rank holds this rank's
    if key not in _root_values:
        call_record.flag("broadcast: the root's value is not known (its rank was not played first); "
                         "this rank's own value stands in")
    return _root_values.get(key)


def save_root_values() -> None:
    """Keeps this rank's small broadcast values for the ranks played later (the first played rank only)."""
    if _values_file is not None and not os.path.exists(_values_file):
        torch.save(_root_values, _values_file)
