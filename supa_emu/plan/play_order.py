"""In which order the planner plays its ranks: one after the other, and side by side where they exchange messages.

Ranks are played in ascending order, one at a time, as before pipeline parallelism: rank 0 first,
so that the ranks after it take the small values it broadcast (world.root_value). A played rank
that waits for a point-to-point message from a played rank that has not started yet (a pipeline
stage waiting for the next stage's metadata, see p2p_messages.py) asks for it, and the planner
starts that rank beside it: pipelining's stages send both ways (the warm-up vote and the shapes
of activations forward, their results and the gradients' shapes backward), so no order of
one-at-a-time plays could give every stage its messages.

`--rank all-stages` plays rank 0 and whichever ranks the played ones exchange messages with, as
they ask for them (at their first send to or recv from the rank, whether or not they wait for
it: Megatron-core's stages exchange only activations and gradients, which no rank waits for): one
rank per pipeline stage of rank 0's pipeline, whatever the script's layout (with "pp" the outermost
mesh dimension, as torchtitan's and Megatron's tp-dp-pp order, rank 0's pipeline is ranks 0, N/PP,
2N/PP, ...). Under the uniform-rank rule the other ranks of a stage (its data, tensor and context
parallel peers) hold what the played one holds; the report names them (stages.py).

When every running rank waits for a message no running rank can send any more (the program's
sends and receives do not match), the planner says so to them (they fail with the call site)
rather than waiting for ever.
"""

import time
from typing import Callable, Dict, List

from supa_emu.plan.plan_directory import PlanDirectory, Unchanged

_POLL_S = 0.02


def play(ranks: List[int], all_stages: bool, shared: str, start: Callable, collect: Callable) -> Dict[int, dict]:
    """Plays `ranks` (and, with `all_stages`, any rank a played one waits for): `start(rank)` starts
    a rank's process (a subprocess.Popen), `collect(rank, returncode)` gives its record once it
    ended. Returns the records by rank."""
    directory = PlanDirectory(shared)
    directory.write_played(ranks, all_stages)
    queue, running, records = list(ranks), {}, {}
    try:
        _play(queue, running, records, all_stages, directory, start, collect)
    finally:
        for process in running.values():  # the planner failed or was interrupted: its ranks end with it
            process.kill()
            process.wait()
    return records


def _play(queue: List[int], running: dict, records: dict, all_stages: bool, directory: PlanDirectory, start,
          collect) -> None:
    stalled = Unchanged()  # what every running rank waits for, while all of them wait for messages
    while queue or running:
        if not running:
            rank = queue.pop(0)
            running[rank] = start(rank)
            continue
        for rank, process in list(running.items()):
            code = process.poll()
            if code is not None:
                records[rank] = collect(rank, code)
                del running[rank]
                directory.mark_ended(rank)
        for peer in sorted(directory.wanted()):
            if peer not in running and peer not in records and (all_stages or peer in queue):
                if peer in queue:
                    queue.remove(peer)
                running[peer] = start(peer)
        waiting = {rank: directory.waits(rank) for rank in running}
        stuck = running and all(wait is not None and wait.message is not None for wait in waiting.values())
        if stalled.stays(waiting if stuck else None):
            directory.mark_stalled()
        time.sleep(_POLL_S)
