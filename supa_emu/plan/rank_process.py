"""The process that plays one rank: `python -m supa_emu.plan.rank_process RECORD SHARED TIMING ROUTING SCRIPT [ARGS...]`
(or `... ROUTING -m MODULE [ARGS...]`).

Started by the planner with the environment a launcher gives (RANK, WORLD_SIZE, LOCAL_RANK,
...) plus SUPA_PLAN_SIMULATE=1, under which activation installed the uniform transport for its
bccl groups (supa_emu.plan.install). It hosts the rendezvous store itself (as torchrun's agent
does, TORCHELASTIC_USE_AGENT_STORE), so init_process_group by env:// finds a store and no peer is
waited for; plays its rank (world.py), gloo groups under the uniform rule too (gloo_groups.py) and
object collectives flagged for the report; records memory and collectives from the first line of the
script on; runs the script unchanged as __main__ (a module as `python -m` runs it); and writes
this rank's record (with the failure, if the script failed) to RECORD as JSON. SHARED is the
plan's directory shared by its ranks: the small values roots broadcast, written by the first rank
played and read by the others (world.root_value), and the point-to-point messages of the played
ranks (p2p_messages.py). TIMING is the time model's settings as JSON (op_stream.start): the card's
profile, the NIC, the host's time per launch, whether to keep a trace. ROUTING is the MoE routing
the plan assumes (moe_routing.py).

What a planned rank cannot do fails at once with one line: starting other ranks
(torch.multiprocessing.spawn), and holding more host tensors than the host can give it (a model
built on the host; SUPA_PLAN_HOST_MEMORY, by default the memory the host has available).
"""

import importlib.util
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


def _runner(target: list):
    """(the code's name for messages, its directory for peak locations, what runs it as __main__)."""
    if target[0] == "-m":
        module = target[1]
        sys.path.insert(0, os.getcwd())  # as `python -m`
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None and spec.origin else module
        sys.argv[0] = origin
        # The code's own package is the user's code, even when it is installed in site-packages.
        top = importlib.util.find_spec(module.split(".")[0])
        roots = list(top.submodule_search_locations or []) if top is not None else []
        return f"-m {module}", roots or [os.path.dirname(origin)], lambda: runpy.run_module(
            module, run_name="__main__", alter_sys=True)
    script = target[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    return script, [os.path.dirname(os.path.abspath(script))], lambda: runpy.run_path(script, run_name="__main__")


ROOT_VALUES = "root_values.pt"  # in the shared directory
SPAWN_REFUSED = ("planner: the script spawns its own ranks (torch.multiprocessing.spawn): a planned rank cannot "
                 "start other ranks; the planner starts one process per rank as a launcher does, so run the script "
                 "without spawning and take RANK and WORLD_SIZE from the environment")


def _refuse_spawning() -> None:
    """torch.multiprocessing.spawn / start_processes raise at once instead of starting ranks that
    would wait for peers the planned world does not have."""
    import torch.multiprocessing as mp

    def refuse(*args, **kwargs):
        raise RuntimeError(SPAWN_REFUSED)

    spawn_module = sys.modules["torch.multiprocessing.spawn"]
    for owner in (mp, spawn_module):
        owner.spawn = owner.start_processes = refuse


def _available_host_memory() -> int:
    """MemAvailable of /proc/meminfo (what the host can give without swapping), else physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main(argv) -> int:
    record_path, shared, timing, routing, *command = argv
    target, args = (command[:2], command[2:]) if command[0] == "-m" else (command[:1], command[1:])
    import torch  # noqa: F401  (activates the emulator: SUPA_EMULATE=1 is in the environment)
    import torch.distributed as dist

    from supa_emu import process_state
    from supa_emu.plan import call_record, gloo_groups, moe_routing, op_stream, p2p_messages, rank_record, world

    host_memory = process_state.config().plan_host_memory
    process_state.core()._limit_host_tensors(host_memory or _available_host_memory())
    _refuse_spawning()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, None, True, wait_for_workers=False)
    os.environ["MASTER_PORT"] = str(store.port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    world.play(rank, world_size, os.path.join(shared, ROOT_VALUES))
    p2p_messages.open_log(shared, rank)
    gloo_groups.install()
    call_record.flag_object_collectives()
    moe_routing.install(routing)

    failure = None
    rank_record.start(None, rank)
    settings = json.loads(timing) or {}
    if settings:
        op_stream.start(settings)
    sys.argv = [target[-1], *args]
    script, user_code, run = _runner(target)
    rank_record.name_user_code(user_code)
    try:
        run()
    except SystemExit as exit:
        if exit.code not in (None, 0):
            failure = _failure(exit)
    except BaseException as error:  # the script's failure is this rank's result
        failure = _failure(error)
        traceback.print_exc()
    if failure is None and world.groups_created() == 0:
        failure = {"error": f"planner: {script} never initialises a process group (init_process_group, "
                            f"deepspeed.init_distributed()); there is no world to plan", "traceback": None}
    world.save_root_values()
    record = rank_record.record(failure)
    record["moe_routing"] = moe_routing.summary()
    record["groups"] = world.memberships()
    record["time"] = op_stream.finish()
    if settings.get("trace"):
        record["trace"] = op_stream.trace_events()
    with open(record_path, "w") as out:
        json.dump(record, out)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
