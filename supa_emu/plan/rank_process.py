"""The process that plays one rank: `python -m supa_emu.plan.rank_process RECORD VALUES SCRIPT [ARGS...]`.

Started by the planner with the environment a launcher gives (RANK, WORLD_SIZE, LOCAL_RANK,
...) plus SUPA_PLAN_SIMULATE=1. It hosts the rendezvous store itself (as torchrun's agent does,
TORCHELASTIC_USE_AGENT_STORE), so init_process_group by env:// finds a store and no peer is
waited for; records memory and collectives from the first line of the script on; runs the
script unchanged as __main__; and writes this rank's record (with the failure, if the script
failed) to RECORD as JSON. VALUES holds the small values roots broadcast, written by the first
rank played and read by the others (see uniform_group).
"""

import json
import os
import runpy
import sys
import traceback


def _failure(error: BaseException) -> dict:
    lines = [line for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()]
    # An error that carries a child's traceback (multiprocessing's) ends with the child's error line.
    return {"error": lines[-1] if any("Traceback" in line for line in lines) else lines[0],
            "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))}


def main(argv) -> int:
    record_path, values_path, script, *args = argv
    import torch  # noqa: F401  (activates the emulator: SUPA_EMULATE=1 is in the environment)
    import torch.distributed as dist

    from supa_emu.plan import rank_record, uniform_group

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, None, True, wait_for_workers=False)
    os.environ["MASTER_PORT"] = str(store.port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    uniform_group.play(rank, world_size, values_path)
    uniform_group.refuse_gloo()
    rank_record.start(None, rank)

    failure = None
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if exit.code not in (None, 0):
            failure = _failure(exit)
    except BaseException as error:  # the script's failure is this rank's result
        failure = _failure(error)
        traceback.print_exc()
    if failure is None and uniform_group.groups_created() == 0:
        failure = {"error": f"planner: {script} never initialises a process group (init_process_group, "
                            f"deepspeed.init_distributed()); there is no world to plan", "traceback": None}
    uniform_group.save_root_values()
    with open(record_path, "w") as out:
        json.dump(rank_record.record(failure), out)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
