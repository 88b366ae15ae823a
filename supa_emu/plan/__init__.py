"""The planner: one process plays any rank of an N-card job and reports its memory and collectives.

`python -m supa_emu.plan --world-size N -- SCRIPT [ARGS...]` (the command, __main__.py) runs the
script unchanged in one process per planned rank (rank_process.py). There, bccl groups carry
their calls with the uniform transport (uniform_transport.py): the world has N ranks of which
only this one exists (world.py), and every collective answers as if each rank held this rank's
data, so the program takes its real path with its real shapes. Point-to-point messages are not
uniform: a played rank's sends reach the played rank that receives them (p2p_messages.py), which
plays beside it where the two need each other's messages (play_order.py). The card, its caching
allocator and its memory history are the ones a real run uses; rank_record.py reads the peak, its
phase and a timeline from that history, and call_record.py counts the collectives. report.py and
plot.py put the ranks together. The same recording runs in a real job under SUPA_PLAN_RECORD=DIR,
to compare. op_stream.py records what the rank launches on its card and time_model.py plays it on
a card profile (supa_emu/card_profiles.py) for the step time (docs/time_on_the_card.md). With
`--mode shapes` operators take their results from PyTorch's shape rules instead of running their
kernels, with the same figures (supa_emu/shapes.py, docs/shapes_mode.md).

supa_emu.distributed never imports this package: the planner plugs into it (`install`).
"""


def install(simulate: bool, record) -> None:
    """What activation installs when the planner's variables ask for it: the uniform transport for
    every bccl group (SUPA_PLAN_SIMULATE, set in the planner's rank processes) and the record of
    memory and collectives from the first bccl group on (SUPA_PLAN_RECORD=`record`, a directory)."""
    if simulate:
        from supa_emu.plan import uniform_transport

        uniform_transport.install()
    if record is not None:
        from supa_emu.plan import rank_record

        rank_record.start(record)


def section(name: str):
    """`with supa_emu.plan.section(name):` marks a part of the script whose peak memory and
    collectives the record gives apart (see rank_record.py); it marks nothing in an unrecorded run."""
    from supa_emu.plan import rank_record  # torch only where a script marks a section

    return rank_record.section(name)


def tokens(n: int) -> None:
    """`supa_emu.plan.tokens(n)`: each training step trains `n` tokens on this rank; the planner then
    reports tokens/s per card (op_stream.py). Like `section`, it marks nothing in an unplanned run."""
    from supa_emu.plan import op_stream

    op_stream.tokens(n)


def step_done() -> None:
    """Ends a training step for the planner's time model where no torch.optim optimizer's `step`
    ends it (a loop without one); it marks nothing in an unplanned run."""
    from supa_emu.plan import op_stream

    op_stream.step_done()
