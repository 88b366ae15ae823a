"""The planner at scale: a ZeRO-3 plan of a GPT (355M parameters by default) for N = 8, 64, 256, 1024 cards,
or of a Llama-2-7B or -70B shape in shapes mode.

    SUPA_EMULATE=1 python bench/plan.py [--world-sizes 8 64 256 1024] [--steps 1] [--model gpt2-medium|small]
    SUPA_EMULATE=1 python bench/plan.py --model llama-2-7b --mode shapes --world-sizes 1024 --steps 2

Each N is one `python -m supa_emu.plan --world-size N --mode MODE` run, playing rank 0 and rank N-1
(one process each, one after the other): of examples/train_gpt.py with examples/configs/zero3.json,
or of examples/finetune_llama.py (DeepSpeed ZeRO-3 under zero.Init, bf16, 4096-token sequences,
one per rank, activation checkpointing).
Printed per N: wall time per played rank, its ratio to the first N's (the reference, measured in
this run), the largest host RSS of a rank process, and each rank's planned peak and collective
calls. The load average at start and end is printed with them: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from harness import load

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPT = [str(ROOT / "examples" / "train_gpt.py"), "--config", str(ROOT / "examples" / "configs" / "zero3.json")]
LLAMA = [str(ROOT / "examples" / "finetune_llama.py"), "--engine", "deepspeed", "--seq", "4096", "--micro", "1"]
MODELS = {
    # GPT-2 medium's shape (355M parameters with this vocabulary); short sequences keep a CPU step short.
    "gpt2-medium": [*GPT, "--vocab", "50257", "--seq-len", "64", "--dim", "1024", "--layers", "24", "--heads", "16"],
    "small": [*GPT, "--vocab", "256", "--seq-len", "16", "--dim", "64", "--layers", "2", "--heads", "4"],
    "llama-2-7b": [*LLAMA, "--shape", "llama-2-7b"],
    "llama-2-70b": [*LLAMA, "--shape", "llama-2-70b"],
}
# Runs the planner and reports the largest RSS among the processes it waited for (the rank processes).
_MEASURE = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print('max_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def plan(world_size: int, model: str, steps: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        report_path = pathlib.Path(directory) / "plan.json"
        command = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "supa_emu.plan", "--world-size",
                   str(world_size), "--mode", mode, "--json", str(report_path), "--", *MODELS[model],
                   "--steps", str(steps)]
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        elapsed = time.perf_counter() - started
        if result.returncode != 0 or not report_path.exists():
            raise SystemExit(f"plan of {world_size} cards failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        rss = next(int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("max_rss_kib"))
        report = json.loads(report_path.read_text())
    return {"elapsed": elapsed, "rss": rss * 1024, "report": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--model", choices=list(MODELS), default="gpt2-medium")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--mode", choices=("compute", "shapes"), default="compute")
    args = parser.parse_args()
    if os.environ.get("SUPA_EMULATE") != "1":
        raise SystemExit("run with SUPA_EMULATE=1")
    print(f"start: {load()}, {os.cpu_count()} cores; {args.model}, {args.mode} mode, {args.steps} step(s)", flush=True)
    print(f"{'N':>6}  {'s per rank':>10}  {'vs first N':>10}  {'host RSS':>9}  {'rank':>5}  {'peak allocated':>14}  "
          f"{'peak reserved':>13}  {'calls':>6}", flush=True)
    reference = None
    for world_size in args.world_sizes:
        result = plan(world_size, args.model, args.steps, args.mode)
        ranks = result["report"]["ranks"]
        per_rank = result["elapsed"] / len(ranks)
        reference = reference or per_rank
        for i, (rank, entry) in enumerate(ranks.items()):
            head = (f"{world_size:>6}  {per_rank:>10.1f}  {per_rank / reference:>10.2f}  "
                    f"{result['rss'] / 2**30:>7.2f}Gi") if i == 0 else " " * 42
            calls = sum(c["count"] for c in entry["collectives"])
            print(f"{head}  {rank:>5}  {entry['peak_allocated'] / 2**20:>10.1f} MiB  "
                  f"{entry['peak_reserved'] / 2**20:>9.1f} MiB  {calls:>6}", flush=True)
    print(f"end: {load()}", flush=True)


if __name__ == "__main__":
    main()
