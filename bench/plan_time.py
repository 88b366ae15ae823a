"""Planned step time on a card for the fidelity reference configurations, and what planning them costs.

    SUPA_EMULATE=1 python bench/plan_time.py [--card H200] [--mode shapes] [--only ARGS] [--steps 3] [--overhead]
    SUPA_EMULATE=1 python bench/plan_time.py --per-op
    SUPA_EMULATE=1 python bench/plan_time.py --published ASSETS [--card H100-96GB-HBM2e]

Each configuration of tests/data/fidelity/h200_reference.jsonl (tests/data/fidelity/memory_probe.py's
arguments, `--fake-world N` among them) is planned as rank 0 of N with `python -m supa_emu.plan
--card CARD`. Printed per configuration: the planned step time (median of the steps after the
first), MFU, the share of the step the card spends compute-bound, memory-bound and on the host,
the card's measured step time where the reference has one (`step_ms_median`, which the probe
records since issue 48; the H200 lines kept so far predate it: "not measured"), and the wall time
of the plan. With --overhead each configuration is also planned with `--no-time` (no operator
stream recorded, no time played) just before, and the ratio of the two wall times is printed:
what recording and timing add to a plan. --per-op measures the same in this process, per operator:
a small layer's forward and backward on supa tensors dispatched with the recorder off and on in
alternating rounds, and the time model playing what was recorded. The load average at start and
end is printed with them: the machine may be shared. --published plans real jobs whose throughput is
published (PUBLISHED: torchtitan's Llama 3.1 runs on H100s; torchtitan must be installed) and
prints planned against published tokens/s per card, with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

from harness import load

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIDELITY = ROOT / "tests" / "data" / "fidelity"
PROBE = FIDELITY / "memory_probe.py"


def plan_report(world: str, card: str, mode: str, script: list, timed: bool = True,
                env: dict | None = None) -> tuple[dict, float]:
    """(rank 0's time report, seconds the plan took) of `script` planned as rank 0 of `world` cards."""
    with tempfile.TemporaryDirectory() as directory:
        out = pathlib.Path(directory) / "plan.json"
        command = [sys.executable, "-m", "supa_emu.plan", "--world-size", str(world), "--rank", "0", "--mode", mode,
                   "--card", card, "--json", str(out), *([] if timed else ["--no-time"]), "--",
                   *[a.replace("{tmp}", directory) for a in script]]
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
        elapsed = time.perf_counter() - started
        if result.returncode != 0 or not out.exists():
            raise SystemExit(f"plan of {shlex.join(script)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return json.loads(out.read_text())["ranks"]["0"]["time"], elapsed


def planned(card_args: str, card: str, mode: str, steps: int, timed: bool = True) -> tuple[dict, float]:
    """(rank 0's time report, seconds the plan took) of one reference configuration."""
    args = shlex.split(card_args)
    at = args.index("--fake-world")
    world, probe_args = args[at + 1], args[:at] + args[at + 2:]
    if "--steps" in probe_args:
        del probe_args[probe_args.index("--steps"):probe_args.index("--steps") + 2]
    return plan_report(world, card, mode, [str(PROBE), *probe_args, "--steps", str(steps)], timed)


# Published throughput of real jobs, planned with the same configuration (docs/time_on_the_card.md,
# "Held to published results"): torchtitan's June 2025 async-TP benchmark on Meta's Grand Teton H100s
# (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, the vanilla TP bf16 rows), tokens/s per
# card as torchtitan's log counts them (tps). The plans run eager with SDPA (as torchtitan's llama3
# did then); the published runs were compiled.
PUBLISHED = (
    {"name": "torchtitan Llama 3.1 8B, 64 cards, FSDP 8 x TP 8, per-op SAC, local batch 12", "world": 64,
     "args": ["--config", "llama3_8b_sdpa", "--training.local-batch-size", "12",
              "--parallelism.tensor-parallel-degree", "8"], "tokens_per_s": 4378.0},
    {"name": "torchtitan Llama 3.1 70B, 256 cards, FSDP 32 x TP 8, full AC, local batch 16", "world": 256,
     "args": ["--config", "llama3_70b_sdpa", "--training.local-batch-size", "16"], "tokens_per_s": 597.3},
)


def published(card: str, steps: int, assets: pathlib.Path) -> None:
    """Plans PUBLISHED (torchtitan on this interpreter, examples/ on the path) and prints planned against
    published tokens/s per card."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "examples"),
                                                                     os.environ.get("PYTHONPATH")]))}
    print(f"cpu: {os.cpu_count()} cores; at start {load()}; card {card}; shapes mode; {steps} steps per plan")
    print(f"{'configuration':<80} {'planned step':>12} {'tokens/s':>9} {'published':>9} {'ratio':>6} {'MFU':>6} "
          f"{'compute':>8} {'memory':>7} {'comm':>6} {'plan wall':>10}")
    for job in PUBLISHED:
        script = ["-m", "torchtitan.train", "--module", "torchtitan_supa", "--hf-assets-path", str(assets / "tokenizer"),
                  "--dataloader.dataset", "c4_test", "--dataloader.dataset-path", str(assets / "c4_test"),
                  "--dump-folder", "{tmp}", "--training.steps", str(steps), *job["args"]]
        timed, elapsed = plan_report(job["world"], card, "shapes", script, env=env)
        split = timed["steps"][-1]["split"]
        total = sum(split.values()) or 1.0
        print(f"{job['name']:<80} {timed['step_seconds']:>10.2f} s {timed['tokens_per_s']:>9,.0f} "
              f"{job['tokens_per_s']:>9,.1f} {timed['tokens_per_s'] / job['tokens_per_s']:>6.2f} {timed['mfu']:>6.1%} "
              f"{split['compute'] / total:>8.0%} {split['memory'] / total:>7.0%} {split['communication'] / total:>6.0%} "
              f"{elapsed:>8.1f} s", flush=True)
    print(f"at end {load()}")


def per_op(rounds: int = 5, iterations: int = 300) -> None:
    """Microseconds per launched operator: dispatch with the recorder off, on, and the model's play."""
    import torch

    from supa_emu import card_profiles, process_state
    from supa_emu.plan import time_model

    core = process_state.core()
    x = torch.randn(64, 256, device="supa", requires_grad=True)
    layer = torch.nn.Linear(256, 256, device="supa")

    def work():
        for _ in range(iterations):
            torch.relu(layer(x)).sum().backward()

    work()
    off, on, played, launches = [], [], [], 0
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        off.append(time.perf_counter() - started)
        core._op_trace_enable(True)
        started = time.perf_counter()
        work()
        on.append(time.perf_counter() - started)
        core._op_trace_enable(False)
        entries = core._op_trace_take()
        launches = sum(1 for e in entries if e[0] == 0)
        schedule = time_model.Schedule(card_profiles.PROFILES["H200"])
        started = time.perf_counter()
        schedule.feed(entries, core._op_trace_names(), [])
        played.append(time.perf_counter() - started)
    per = 1e6 / launches
    print(f"cpu: {os.cpu_count()} cores, {load()}; {launches} operators recorded per round (views included), "
          f"{rounds} rounds")
    print(f"recorder off {min(off) * per:.1f} us/op, on {min(on) * per:.1f} us/op (ratio {min(on) / min(off):.2f}); "
          f"time model {min(played) * per:.1f} us/op (fastest rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", help="the card profile (default H200; H100-96GB-HBM2e with --published)")
    parser.add_argument("--mode", default="shapes", choices=("compute", "shapes"))
    parser.add_argument("--steps", type=int, default=3, help="steps per plan (the first is not in the median)")
    parser.add_argument("--overhead", action="store_true", help="also plan without the time model, for the ratio")
    parser.add_argument("--per-op", action="store_true", help="the recorder's cost per operator, in this process")
    parser.add_argument("--only", help="plan only the reference line with these arguments")
    parser.add_argument("--published", type=pathlib.Path, metavar="ASSETS",
                        help="plan the published jobs instead (torchtitan's; ASSETS holds tokenizer/ and c4_test/, "
                             "docs/frameworks.md); --card defaults to H100-96GB-HBM2e")
    args = parser.parse_args()
    if args.per_op:
        per_op()
        return
    if args.published:
        published(args.card or "H100-96GB-HBM2e", args.steps, args.published.resolve())
        return
    args.card = args.card or "H200"
    reference = [json.loads(line) for line in (FIDELITY / "h200_reference.jsonl").read_text().splitlines() if line]
    if args.only:
        reference = [r for r in reference if r["args"] == args.only]
    print(f"cpu: {os.cpu_count()} cores; at start {load()}; card {args.card}; {args.mode} mode; "
          f"{args.steps} steps per plan")
    print(f"{'configuration':<58} {'planned step':>12} {'MFU':>6} {'compute':>8} {'memory':>7} {'host':>6} "
          f"{'measured':>12} {'plan wall':>10}" + (f" {'untimed':>9} {'ratio':>6}" if args.overhead else ""))
    for line in reference:
        untimed = planned(line["args"], args.card, args.mode, args.steps, timed=False)[1] if args.overhead else None
        timed, elapsed = planned(line["args"], args.card, args.mode, args.steps)
        split = timed["steps"][-1]["split"]
        total = sum(split.values()) or 1.0
        measured = f"{line['step_ms_median']:.1f} ms" if "step_ms_median" in line else "not measured"
        print(f"{line['args']:<58} {timed['step_seconds'] * 1e3:>9.1f} ms {timed['mfu']:>6.1%} "
              f"{split['compute'] / total:>8.0%} {split['memory'] / total:>7.0%} {split['host'] / total:>6.0%} "
              f"{measured:>12} {elapsed:>8.1f} s"
              + (f" {untimed:>7.1f} s {elapsed / untimed:>6.2f}" if untimed else ""), flush=True)
    print(f"at end {load()}")


if __name__ == "__main__":
    main()
