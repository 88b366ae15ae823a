"""The planner's report: the ranks' records put together, as JSON and as a table for people.

JSON keys: world_size, cards_per_host, mode ("compute" or "shapes"), moe_routing (the routing assumed for
MoE routers: moe_routing.py), script, args, capacity,
ranks -> "R" -> {mode, peak_allocated, peak_reserved, peak_phase, peak_location, capacity, oom,
oom_events ([{requested_bytes, allocated, reserved, time_s, phase, location}]), timeline ([event
index, seconds since recording started, allocated, reserved] points), collectives ([{op,
group_size, dtype, bytes, count}]), value_dependent ([{what, count, site}]), no_shape_rule (shapes
mode's operators that ran their kernels for want of a shape rule, [{what, count, site}]),
sections ([{name, peak_allocated, peak_reserved, collectives}], see rank_record.section), failure
({error, traceback} or null), failed (true when the rank did not run to the end: its figures are
those up to its failure), with --rank all-stages: stage (its pipeline stage, null where not derived),
stands_for (the ranks whose figures are its own under the uniform rule, as runs of consecutive ranks,
[[first, last], ...]), stands_for_why (null, or why the stages were not derived: it stands for itself
alone; stages.py), moe_routing ({assumed,
routers: {class: forward calls that chose the assumed experts}}), time (the card's time, time_model.Schedule.report: card, steps
[{step, seconds, flops, mfu, split, tokens}], step_seconds, tokens_per_s, mfu, top_ops, untimed_collectives,
point_to_point ({timed_with_peer, timed_alone: {why: transfers}}, p2p_time.py); null where no step was
recorded)}, largest -> peak_allocated / peak_reserved -> {rank, bytes, failed}: the
largest figure over the played ranks and the rank that holds it.
"""

from typing import Dict

from supa_emu.plan import stages
from supa_emu.plan.plot import FAILED, _size


def lost_rank(rank: int, returncode: int) -> dict:
    """The record of a rank process that ended before writing its own (killed, crashed)."""
    return {"rank": rank, "device": None, "capacity": 0, "peak_allocated": 0, "peak_reserved": 0,
            "peak_phase": "unknown", "peak_location": None, "oom": False, "oom_events": [], "timeline": [],
            "collectives": [], "value_dependent": [], "no_shape_rule": [], "sections": [], "time": None,
            "failure": {"error": f"the rank process ended with status {returncode} before writing its record",
                        "traceback": None}}


def build(world_size: int, cards_per_host: int, script: str, args, records: Dict[int, dict], mode: str,
          moe_routing: str = "balanced", all_stages: bool = False) -> dict:
    ranks = {str(rank): dict(record, failed=record["failure"] is not None) for rank, record in sorted(records.items())}
    groups = {rank: entry.pop("groups", []) for rank, entry in ranks.items()}  # the planner's own, not reported
    if all_stages:
        for rank, stand_in in stages.stand_ins(world_size, {int(r): g for r, g in groups.items()}).items():
            ranks[str(rank)].update(stage=stand_in["stage"], stands_for=stand_in["stands_for"],
                                    stands_for_why=stand_in["why"])
    return {"world_size": world_size, "cards_per_host": cards_per_host, "mode": mode, "moe_routing": moe_routing,
            "script": script, "args": list(args),
            "capacity": max(r["capacity"] for r in records.values()),
            "ranks": ranks, "largest": {key: _largest(ranks, key) for key in ("peak_allocated", "peak_reserved")}}


def _largest(ranks: Dict[str, dict], key: str) -> dict:
    rank, record = max(ranks.items(), key=lambda item: (item[1][key], -int(item[0])))
    return {"rank": int(rank), "bytes": record[key], "failed": record["failed"]}



def text(report: dict) -> str:
    lines = [f"plan of {report['script']} on {report['world_size']} cards "
             f"({report['cards_per_host']} per host, {_size(report['capacity'])} each), {report['mode']} mode",
             f"{'rank':>5}  {'peak allocated':>15}  {'peak reserved':>14}  {'phase of the peak':<18}  "
             f"{'OOM':<3}  {'collective calls':>16}  {'bytes sent/received':>19}  ran"]
    for rank, r in report["ranks"].items():
        calls = sum(c["count"] for c in r["collectives"])
        volume = sum(c["count"] * c["bytes"] for c in r["collectives"])
        lines.append(f"{rank:>5}  {_size(r['peak_allocated']):>15}  {_size(r['peak_reserved']):>14}  "
                     f"{r['peak_phase']:<18}  {'yes' if r['oom'] else 'no':<3}  {calls:>16}  {_size(volume):>19}  "
                     f"{FAILED if r['failed'] else 'to the end'}")
    if len(report["ranks"]) > 1:
        allocated, reserved = report["largest"]["peak_allocated"], report["largest"]["peak_reserved"]
        lines.append(f"largest: {_size(allocated['bytes'])} allocated on rank {allocated['rank']}"
                     f"{' (FAILED)' if allocated['failed'] else ''}, {_size(reserved['bytes'])} reserved on rank "
                     f"{reserved['rank']}{' (FAILED)' if reserved['failed'] else ''}")
    played = [(rank, r) for rank, r in report["ranks"].items() if "stands_for" in r]
    for rank, r in played:
        lines.append(stages.describe(int(rank), r["stage"], len(played), r["stands_for"], r["stands_for_why"]))
    lines.extend(_routing_lines(report))
    for rank, r in report["ranks"].items():
        lines.extend(time_lines(rank, r.get("time")))
    for rank, r in report["ranks"].items():
        for oom in r["oom_events"]:
            where = f" at {oom['location']}" if oom.get("location") else ""
            lines.append(f"rank {rank}: out of memory asking for {_size(oom['requested_bytes'])} in "
                         f"{oom.get('phase', 'unknown')}{where}, with {_size(oom['allocated'])} allocated, "
                         f"{_size(oom['reserved'])} reserved of {_size(r['capacity'])}")
        if r["failure"]:
            lines.append(f"rank {rank} failed: {r['failure']['error']}")
        for note in r["value_dependent"]:
            site = f" at {note['site']}" if note.get("site") else ""
            lines.append(f"rank {rank}: depends on values ({note['count']}x): {note['what']}{site}")
        for note in r.get("no_shape_rule", []):
            lines.append(f"rank {rank}: ran a kernel ({note['count']}x): {note['what']} at {note['site']}")
    return "\n".join(lines)


def _routing_lines(report: dict) -> list:
    """The MoE routing the plan assumed, where a rank ran a router (a plan without MoE says nothing)."""
    routed = {rank: (r.get("moe_routing") or {}).get("routers") for rank, r in report["ranks"].items()}
    routed = {rank: routers for rank, routers in routed.items() if routers}
    if not routed:
        return []
    calls = "; ".join(f"rank {rank}: " + ", ".join(f"{kind} {count}x" for kind, count in routers.items())
                      for rank, routers in routed.items())
    return [f"MoE routing assumed: {report['moe_routing']} (routers that chose by it: {calls})"]


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def time_lines(rank, time) -> list:
    """A rank's planned step time, its split and its most expensive operators, for people."""
    if not time or not time["steps"]:
        return [] if time is None else [f"rank {rank}: no training step seen on {time['card']} (an optimizer's "
                                        f"step, or supa_emu.plan.step_done(), ends one)"]
    steps = ", ".join(_seconds(s["seconds"]) for s in time["steps"])
    lines = [f"rank {rank} on {time['card']}: step {_seconds(time['step_seconds'])} (median after the first; "
             f"steps: {steps}), MFU {time['mfu']:.1%}"
             + (f", {time['tokens_per_s']:,.0f} tokens/s" if time.get("tokens_per_s") else "")]
    last = time["steps"][-1]
    total = sum(last["split"].values()) or 1.0
    lines.append(f"rank {rank}: last step's time: " + ", ".join(
        f"{name} {share / total:.0%}" for name, share in last["split"].items() if share > 0))
    lines.append(f"rank {rank}: most expensive operators: " + ", ".join(
        f"{op['op']} {_seconds(op['seconds'])} ({op['count']}x)" for op in time["top_ops"][:5]))
    for untimed in time.get("untimed_collectives", []):
        lines.append(f"rank {rank}: no time model for the collective {untimed['op']} ({untimed['count']}x): "
                     f"counted as taking no time")
    return lines + transfer_lines(rank, time.get("point_to_point") or {})


def transfer_lines(rank, transfers: dict) -> list:
    """What the point-to-point transfers timed without their peer leave out (p2p_time.py)."""
    alone = transfers.get("timed_alone", {})
    lines = []
    if alone.get("peer not played"):
        lines.append(f"rank {rank}: {alone['peer not played']} point-to-point transfers with ranks the plan does not "
                     f"play are timed from this rank's side alone: the pipeline's waits (its bubble) are not "
                     f"modelled; play every stage (--rank all-stages) for them")
    others = {why: n for why, n in alone.items() if why != "peer not played"}
    if others:
        lines.append(f"rank {rank}: point-to-point transfers timed without their peer's side: " + ", ".join(
            f"{n} ({why})" for why, n in others.items()) + f"; {transfers.get('timed_with_peer', 0)} with it")
    return lines
