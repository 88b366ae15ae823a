"""`python -m supa_emu.plan --world-size N [--rank R[,R...]|all-stages]... [--cards-per-host K] [--mode compute|shapes]
[--moe-routing balanced|worst|router] [--card NAME|FILE.toml] [--nic-gbps G] [--host-op-us US] [--json OUT]
[--plot OUT] [--trace OUT.json] -- SCRIPT [ARGS...]`
(or `-- -m MODULE [ARGS...]`, run as `python -m MODULE` would run it)

Runs SCRIPT once per requested rank (rank N-1 unless told) and for rank 0, each in its own process
that plays that rank of an N-card world (see supa_emu/plan/__init__.py), one after the other
(side by side where one waits for another's message: play_order.py), then prints each rank's
peak memory, collectives and planned step time on the card (--card; see docs/time_on_the_card.md)
and writes the JSON report, the plot and the trace.
With --mode shapes, operators take their results from PyTorch's shape rules instead of running
their kernels (docs/shapes_mode.md): the same figures, at the cost of the Python program alone.
Exit status: 0 when every planned rank ran to the end, 1 when one failed (out of memory
included: the report says where), 2 for bad arguments.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from supa_emu import card_profiles
from supa_emu.config import PLAN_MODES
from supa_emu.plan import moe_routing, play_order, plot, report, time_model, trace

MAX_CARDS_PER_HOST = 64  # SUPA_EMU_DEVICE_COUNT's limit
ALL_STAGES = "all-stages"


class UsageError(Exception):
    pass


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m supa_emu.plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("--world-size", type=int, required=True, help="cards in the planned job (N)")
    parser.add_argument("--rank", action="append", dest="ranks",
                        help="ranks to play: R, a list R,R,... (repeatable), or all-stages (rank 0 and the ranks "
                             "it exchanges messages with: one per pipeline stage); default N-1; rank 0 is always "
                             "played, first")
    parser.add_argument("--cards-per-host", type=int, help="cards per host (LOCAL_WORLD_SIZE); default min(N, 8)")
    parser.add_argument("--mode", default="compute",
                        help="compute (default): run every operator's kernel; shapes: take results from PyTorch's "
                             "shape rules without running kernels (same memory figures, no FLOPs)")
    parser.add_argument("--moe-routing", default=moe_routing.BALANCED,
                        help="the routing MoE routers are assumed to choose: balanced (default: every expert gets an "
                             "even share of the tokens), worst (every rank routes to this rank's experts, as far as "
                             "the capacity allows), router (the program's router decides; compute mode only)")
    parser.add_argument("--card", help=f"the card whose time (and, given, memory) is planned: "
                                       f"{', '.join(card_profiles.PROFILES)}, or a profile file (.toml); "
                                       f"default the emulated card (SUPA_EMU_PROFILE)")
    parser.add_argument("--nic-gbps", type=float, default=400.0,
                        help="inter-host network per card, Gb/s (default 400)")
    parser.add_argument("--host-op-us", type=float, default=time_model.HOST_OP_SECONDS * 1e6,
                        help="the host's time per launched operator, microseconds "
                             f"(default {time_model.HOST_OP_SECONDS * 1e6:g})")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="write the memory chart here (.svg, or .html with a table)")
    parser.add_argument("--no-time", action="store_true",
                        help="plan memory and collectives only: record no operator stream, plan no step time")
    parser.add_argument("--trace", help="write the planned steps as a Chrome/Perfetto trace here (.json)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...] or -- -m MODULE [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    n = args.world_size
    if n < 1:
        raise UsageError(f"--world-size {n}: a world has at least 1 rank")
    # Rank 0 is always played, first: later ranks take the values it broadcasts (world.root_value).
    args.ranks, args.all_stages = _ranks(args.ranks or [str(n - 1)])
    args.ranks = sorted(set(args.ranks) | {0})
    outside = [r for r in args.ranks if not 0 <= r < n]
    if outside:
        raise UsageError(f"--rank {outside[0]} is outside the world of {n} ranks (0 to {n - 1})")
    args.cards_per_host = args.cards_per_host or min(n, 8)
    if args.mode not in PLAN_MODES:
        raise UsageError(f"--mode {args.mode}: accepted values: {', '.join(PLAN_MODES)}")
    if args.moe_routing not in moe_routing.ROUTINGS:
        raise UsageError(f"--moe-routing {args.moe_routing}: accepted values: {', '.join(moe_routing.ROUTINGS)}")
    if args.moe_routing == moe_routing.ROUTER and args.mode == "shapes":
        raise UsageError("--moe-routing router needs --mode compute: in shapes mode the router's scores are not "
                         "computed, so its choice would be made on zeros; assume balanced or worst routing instead")
    if not 1 <= args.cards_per_host <= MAX_CARDS_PER_HOST:
        raise UsageError(f"--cards-per-host {args.cards_per_host}: accepted 1 to {MAX_CARDS_PER_HOST}")
    if args.plot and not args.plot.endswith(plot.SUFFIXES):
        raise UsageError(f"--plot {args.plot}: the chart is SVG, written as .svg or .html (a .png needs "
                         f"matplotlib, which the project does not depend on)")
    try:
        args.profile = card_profiles.choose(args.card or os.environ.get("SUPA_EMU_PROFILE", "").strip().upper() or None)
    except card_profiles.ProfileError as error:
        raise UsageError(str(error)) from None
    if not args.nic_gbps > 0:
        raise UsageError(f"--nic-gbps {args.nic_gbps:g}: accepted a positive number of Gb/s per card")
    if not args.host_op_us >= 0:
        raise UsageError(f"--host-op-us {args.host_op_us:g}: accepted 0 or more microseconds")
    if args.trace and args.no_time:
        raise UsageError("--trace needs the step time that --no-time turns off")
    if args.trace and not args.trace.endswith(".json"):
        raise UsageError(f"--trace {args.trace}: the trace is Chrome's JSON format, written as .json")
    if not command:
        raise UsageError("no script: give it after --, e.g. -- examples/train_gpt.py --config CONFIG")
    if command[0] == "-m":
        if len(command) < 2:
            raise UsageError("-m needs a module name, e.g. -- -m torchtitan.train ARGS")
        _check_module(command[1])
        args.target, args.script, args.script_args = command[:2], f"-m {command[1]}", command[2:]
        return args
    if not os.path.isfile(command[0]):
        raise UsageError(f"{command[0]}: no such script")
    args.target, args.script, args.script_args = command[:1], command[0], command[1:]
    return args


def _ranks(values) -> tuple:
    """(the ranks named, whether all-stages was asked) of the --rank values."""
    ranks, all_stages = [], False
    for value in values:
        for item in value.split(","):
            if item.strip() == ALL_STAGES:
                all_stages = True
                continue
            try:
                ranks.append(int(item))
            except ValueError:
                raise UsageError(f"--rank {value}: accepted a rank, a list of ranks (0,4) or {ALL_STAGES}") from None
    return ranks, all_stages


def _check_module(name: str) -> None:
    """Refuses a module `python -m` could not run (finding it imports its parent packages only)."""
    sys.path.insert(0, os.getcwd())  # `python -m` looks in the working directory first
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as error:
        raise UsageError(f"-m {name}: {error}") from None
    finally:
        sys.path.pop(0)
    if spec is None:
        raise UsageError(f"-m {name}: no module named {name!r}")


def rank_environment(rank: int, world_size: int, cards_per_host: int, mode: str = "compute",
                     card_memory: int = None) -> dict:
    """What a launcher (torchrun) gives rank `rank`, plus the planner's switches; `card_memory`:
    the capacity of the chosen card, unless SUPA_EMU_MEMORY says otherwise."""
    host, local_rank = divmod(rank, cards_per_host)
    local_world = min(cards_per_host, world_size - host * cards_per_host)
    env = dict(os.environ)
    env.pop("SUPA_PLAN_RECORD", None)
    env.update({
        "SUPA_EMULATE": "1", "SUPA_PLAN_SIMULATE": "1", "SUPA_PLAN_MODE": mode, "SUPA_EMU_DEVICE_COUNT": str(cards_per_host),
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(host), "NODE_RANK": str(host),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "0",  # the rank process hosts the store and sets the port it got
    })
    if card_memory is not None and "SUPA_EMU_MEMORY" not in env:
        env["SUPA_EMU_MEMORY"] = str(card_memory)
    return env


def timing_settings(rank: int, args) -> str:
    """The time model's settings for a rank process (op_stream.start), as JSON (null: --no-time)."""
    if args.no_time:
        return "null"
    return json.dumps({"card": card_profiles.as_fields(args.profile), "nic_gbps": args.nic_gbps,
                       "host_op_s": args.host_op_us * 1e-6, "rank": rank, "cards_per_host": args.cards_per_host,
                       "trace": bool(args.trace)})


def start_rank(rank: int, args, shared: str) -> subprocess.Popen:
    print(f"plan: rank {rank} of {args.world_size} ({args.mode} mode): {args.script} "
          f"{' '.join(args.script_args)}", flush=True)
    command = [sys.executable, "-m", "supa_emu.plan.rank_process", _record_path(shared, rank), shared,
               timing_settings(rank, args), args.moe_routing, *args.target, *args.script_args]
    memory = args.profile.memory_bytes if args.card else None
    return subprocess.Popen(command, env=rank_environment(rank, args.world_size, args.cards_per_host, args.mode,
                                                          memory))


def collect_rank(rank: int, returncode: int, shared: str) -> dict:
    path = _record_path(shared, rank)
    if os.path.exists(path):
        with open(path) as record:
            return json.load(record)
    return report.lost_rank(rank, returncode)


def _record_path(shared: str, rank: int) -> str:
    return os.path.join(shared, f"rank-{rank}.json")


def main(argv=None) -> int:
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="supa_emu-plan-") as shared:
        records = play_order.play(args.ranks, args.all_stages, shared, lambda rank: start_rank(rank, args, shared),
                                  lambda rank, code: collect_rank(rank, code, shared))
    traces = [records[rank].pop("trace", None) or [] for rank in sorted(records)]
    full = report.build(args.world_size, args.cards_per_host, args.script, args.script_args, records, args.mode,
                        args.moe_routing, args.all_stages)
    print(report.text(full), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(full, out, indent=1)
    if args.plot:
        plot.write(full, args.plot)
    if args.trace:
        trace.write(args.trace, traces)
    return 1 if any(r["failure"] for r in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
