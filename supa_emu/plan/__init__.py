"""The planner: one process plays any rank of an N-card job and reports its memory and collectives.

`python -m supa_emu.plan --world-size N -- SCRIPT [ARGS...]` (the command, __main__.py) runs the
script unchanged in one process per planned rank (rank_process.py). There, bccl groups are
uniform-rank groups (uniform_group.py): the world has N ranks of which only this one exists,
and every collective answers as if each rank held this rank's data, so the program takes its
real path with its real shapes. The card, its caching allocator and its memory history are the
ones a real run uses; rank_record.py reads the peak, its phase and a timeline from that history,
and the collectives from supa_emu.distributed.call_record. report.py and plot.py put the ranks
together. The same recording runs in a real job under SUPA_PLAN_RECORD=DIR, to compare. With
`--mode shapes` operators take their results from PyTorch's shape rules instead of running their
kernels, with the same figures (supa_emu/shapes.py, docs/shapes_mode.md).
"""


def section(name: str):
    """`with supa_emu.plan.section(name):` marks a part of the script whose peak memory and
    collectives the record gives apart (see rank_record.py); it marks nothing in an unrecorded run."""
    from supa_emu.plan import rank_record  # torch only where a script marks a section

    return rank_record.section(name)
