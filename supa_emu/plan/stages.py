"""Which ranks of the world each rank an all-stages plan played stands for.

`--rank all-stages` plays rank 0's pipeline, one rank per stage (play_order.py). Under the
uniform-rank rule the other ranks of a stage (its data, tensor, context and expert parallel peers)
hold what the played one holds, so the report names, for each played rank, the ranks it stands for.
(Tensor parallel peers hold it to the byte; data parallel peers that keep other shards of a sharded
optimizer make the same calls, with figures that can differ by the allocator's rounding of their
shards: docs/planner.md, "Pipeline parallelism".)

The rule, for a world laid out as a mesh of ranks with a pipeline dimension of stride s (Megatron's
tp-dp-pp order, torchtitan's DeviceMesh, DeepSpeed's pipe-data topology): rank 0's pipeline is ranks
0, s, 2s, ..., (PP-1)s, and rank r is in stage (r // s) % PP. The played ranks give s and PP; the
groups each played rank was in check the layout: a group holding no other played rank (its tensor,
data parallel group...) must lie within the played rank's stage. Where the played ranks are not such
a progression, or a group crosses stages, the report says the stages were not derived, and each
played rank stands for itself alone.
"""

from typing import Dict, List, Optional


def stand_ins(world_size: int, groups: Dict[int, List[List[int]]]) -> Dict[int, dict]:
    """{played rank: {stage, stands_for (its ranks as runs), why (None, or why the stages were not derived)}}
    of an all-stages plan; `groups[rank]` is the global ranks of each group the played rank was in."""
    played = sorted(groups)
    layout = _mesh_layout(world_size, played)
    if isinstance(layout, str):
        return _not_derived(played, layout)
    stride, stages = layout
    members = {rank: [r for r in range(world_size) if (r // stride) % stages == stage]
               for stage, rank in enumerate(played)}
    for rank in played:
        stage = set(members[rank])
        for group in groups[rank]:
            if not any(other in group for other in played if other != rank) and not stage >= set(group):
                return _not_derived(played, f"rank {rank}'s group of ranks {_ranges(group)} holds ranks of other "
                                            f"stages (ranks {_ranges(sorted(set(group) - stage))})")
    return {rank: {"stage": stage, "stands_for": runs(members[rank]), "why": None}
            for stage, rank in enumerate(played)}


def _mesh_layout(world_size: int, played: List[int]):
    """(stride, stages) of the pipeline dimension the played ranks span, or why there is none."""
    if len(played) == 1:
        return 1, 1  # one stage: the played rank stands for every rank
    stride = played[1] - played[0]
    if played[0] != 0 or played != [stage * stride for stage in range(len(played))]:
        return f"the played ranks {_ranges(played)} are not 0, s, 2s, ... (one pipeline of a rank mesh)"
    if world_size % (stride * len(played)):
        return (f"{len(played)} stages {stride} ranks apart do not divide the world of {world_size} ranks "
                f"into pipelines")
    return stride, len(played)


def _not_derived(played: List[int], why: str) -> Dict[int, dict]:
    return {rank: {"stage": None, "stands_for": [[rank, rank]], "why": why} for rank in played}


def runs(ranks: List[int]) -> List[List[int]]:
    """Ranks as runs of consecutive ranks, [[first, last], ...] (the report's `stands_for`)."""
    found: List[List[int]] = []
    for rank in sorted(ranks):
        if found and rank == found[-1][1] + 1:
            found[-1][1] = rank
        else:
            found.append([rank, rank])
    return found


def _ranges(ranks: List[int]) -> str:
    return _shown(runs(ranks))


def _shown(of: List[List[int]], limit: int = 8) -> str:
    """Runs as `0-7, 16-23`: the first `limit` runs, then how many ranks in all where there are more."""
    shown = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in of[:limit])
    return shown + (f", ... ({sum(b - a + 1 for a, b in of)} ranks)" if len(of) > limit else "")


def describe(rank: int, stage: Optional[int], stages: int, stands_for: List[List[int]], why: Optional[str]) -> str:
    """The report's line for a played rank of an all-stages plan (`stands_for` as runs)."""
    if why is not None:
        return f"rank {rank} stands for itself alone: the stages were not derived ({why})"
    return f"rank {rank} (stage {stage} of {stages}) stands for ranks {_shown(stands_for)}"
