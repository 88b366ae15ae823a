"""One DeepSpeed training script on DeepSpeed's CPU accelerator and on emulated SUPA cards, step time side by side.

    python bench/deepspeed_step.py [--stages 0 1 2 3] [--rounds 3] [--steps 40] [--warmup 8]

The same script runs as 2 ranks (torchrun) twice per round: once with DS_ACCELERATOR=cpu (gloo,
no emulator) and once with SUPA_EMULATE=1 (DeepSpeed picks SUPA, bccl). Rounds alternate the two
sides, in the order cpu, supa, supa, cpu, ... so a load drift hits both alike. Each job trains the
same model (an MLP of --layers Linear+GELU blocks --width wide, bf16, DeepSpeed's Adam from the
config) at every requested ZeRO stage and reports rank 0's median step time over the steps after
the warm-up ones. The table gives the median over rounds and the supa/cpu ratio per stage.
Machines are noisy: read the ratios; the load average at start and end is printed with them.
Single steps vary 2-3x on a 2-core machine (gloo's all_reduce time does, on both sides), hence
40 measured steps per stage and job by default: with 10, the same code gave stage ratios 0.1 apart.

    python bench/deepspeed_step.py --against ../base        # e.g. git worktree add ../base 13904d9

adds a third side: the emulated supa job run from another checkout of this project (its supa_emu,
accelerator and op builders, and the native core built from its sources), in the same rotation,
with the columns base and supa/base: two commits side by side in one run. Each job reports which
checkout it ran, and the driver refuses a mix-up.

    python bench/deepspeed_step.py --count-calls [--against ../base]

counts instead of timing: one job per side, in which rank 0 counts the Python function calls of
each measured step on its calling thread (sys.setprofile): in all, in supa_emu, and in
supa_emu/distributed (bccl). Unlike step times, the counts barely depend on the machine's load
(a wait that spins longer adds a few).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

from harness import ROOT, checkout_argument, checkout_env, commit, load, running_checkout

WORLD = 2
MARK = "DEEPSPEED_STEP "  # rank 0's result lines start with this
JOB_TIMEOUT_S = 900



# ------------------------------------------------------------------------------------------------
# One rank of one job
# ------------------------------------------------------------------------------------------------
def _ds_config(stage: int, micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                 "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500_000, "allgather_bucket_size": 500_000},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def _worker(args) -> None:
    import torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    torch.set_num_threads(1)  # two ranks share the machine's two cores, on both sides alike
    accelerator = get_accelerator()
    local_rank = int(os.environ["LOCAL_RANK"])
    accelerator.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
    rank = torch.distributed.get_rank()
    device = torch.device(accelerator.device_name(local_rank))
    for stage in args.stages:
        torch.manual_seed(1234)
        blocks = []
        for _ in range(args.layers):
            blocks += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
        model = torch.nn.Sequential(*blocks)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=_ds_config(stage, args.batch))
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.width, generator=generator).to(device, torch.bfloat16)
        y = torch.randn(args.batch, args.width, generator=generator).to(device, torch.bfloat16)
        seconds = []
        counter = _CallCounter() if args.count_calls else None
        for step in range(args.warmup + args.steps):
            accelerator.synchronize()
            if counter is not None and step == args.warmup:
                sys.setprofile(counter)
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            accelerator.synchronize()
            seconds.append(time.perf_counter() - start)
        sys.setprofile(None)
        measured = seconds[args.warmup:]
        if rank == 0:
            calls = None if counter is None else {where: count / args.steps for where, count in counter.counts.items()}
            print(MARK + json.dumps({"stage": stage, "median_s": statistics.median(measured),
                                     "accelerator": accelerator.device_name(),
                                     "checkout": _checkout_of(type(accelerator)),
                                     "backend": accelerator.communication_backend_name(),
                                     "loss": float(loss), "calls": calls}), flush=True)
        engine.destroy()
        del engine, model
    torch.distributed.destroy_process_group()


class _CallCounter:
    """sys.setprofile's function: counts Python function calls, in all and in supa_emu's files."""

    def __init__(self):
        checkout = running_checkout()
        self._package = os.path.join(checkout, "supa_emu", "") if checkout else None
        self._bccl = os.path.join(checkout, "supa_emu", "distributed", "") if checkout else None
        self.counts = {"all": 0, "supa_emu": 0, "bccl": 0}

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        self.counts["all"] += 1
        if self._package is not None and frame.f_code.co_filename.startswith(self._package):
            self.counts["supa_emu"] += 1
            if frame.f_code.co_filename.startswith(self._bccl):
                self.counts["bccl"] += 1


def _checkout_of(accelerator_class) -> str | None:
    """The checkout whose supa_emu and accelerator this job runs (None on DeepSpeed's own accelerators)."""
    import inspect

    checkout = running_checkout()
    if checkout is None or not accelerator_class.__module__.startswith("supa_deepspeed"):
        return None
    accelerator_root = str(pathlib.Path(os.path.realpath(inspect.getfile(accelerator_class))).parents[1])
    return checkout if accelerator_root == checkout else f"mixed: {sorted({checkout, accelerator_root})}"


# ------------------------------------------------------------------------------------------------
# The driver: alternating jobs on each side
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _side_env(side: str, against: pathlib.Path | None) -> dict:
    env = dict(os.environ)
    if side == "cpu":
        env.pop("SUPA_EMULATE", None)
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env["SUPA_EMULATE"] = "1"
        env["DS_ACCELERATOR"] = "supa"
    if side == "base":
        env = checkout_env(env, against)
    elif side == "supa" and running_checkout() != str(ROOT):
        env = checkout_env(env, ROOT)  # run from a checkout the editable install does not point at
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _expected_checkout(side: str, against: pathlib.Path | None) -> str | None:
    return {"cpu": None, "supa": str(ROOT), "base": str(against)}[side]


def _run_job(side: str, args) -> dict[int, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               str(pathlib.Path(__file__).resolve()), "--worker",
               "--stages", *map(str, args.stages), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
    if args.count_calls:
        command.append("--count-calls")
    result = subprocess.run(command, cwd=ROOT, env=_side_env(side, args.against), capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_S)
    rows = [json.loads(line[len(MARK):]) for line in result.stdout.splitlines() if line.startswith(MARK)]
    if len(rows) != len(args.stages):
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-8000:])
        raise SystemExit(f"the {side} job failed (exit code {result.returncode})")
    if result.returncode != 0:
        # Every stage was measured; the job died on the way out. Seen on the CPU side without
        # the emulator (about 1 job in 14): "terminate called without an active exception" when
        # a gloo thread releases a Python-owned tensor while the interpreter shuts down.
        last = [line for line in result.stderr.splitlines() if "terminate" in line or "Error" in line][-1:]
        print(f"note: the {side} job exited with code {result.returncode} after reporting every stage "
              f"({last[0].strip() if last else 'no error line'}); its timings are kept")
    for row in rows:
        expected = "cpu" if side == "cpu" else "supa"
        if row["accelerator"] != expected:
            raise SystemExit(f"the {side} job ran on DeepSpeed's {row['accelerator']!r} accelerator")
        if row["checkout"] != _expected_checkout(side, args.against):
            raise SystemExit(f"the {side} job ran the checkout {row['checkout']}, "
                             f"not {_expected_checkout(side, args.against)}")
    if args.count_calls:
        return {row["stage"]: row["calls"] for row in rows}
    return {row["stage"]: row["median_s"] for row in rows}


def _print_calls(args, sides) -> None:
    """--count-calls: one job per side, Python calls per step on rank 0's calling thread."""
    calls = {side: _run_job(side, args) for side in sides}
    print(f"Python function calls per step, rank 0's calling thread, mean of {args.steps} steps after "
          f"{args.warmup} (bccl: supa_emu/distributed)")
    print(f"{'ZeRO stage':<12}{'side':<6}{'all':>10}{'supa_emu':>10}{'bccl':>8}")
    for stage in args.stages:
        for side in sides:
            counts = calls[side][stage]
            print(f"{stage:<12}{side:<6}{counts['all']:>10.1f}{counts['supa_emu']:>10.1f}{counts['bccl']:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--rounds", type=int, default=3, help="jobs per side (alternating)")
    parser.add_argument("--steps", type=int, default=40, help="measured steps per stage and job")
    parser.add_argument("--warmup", type=int, default=8, help="steps run before measuring")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="micro batch per rank")
    parser.add_argument("--against", type=pathlib.Path, metavar="CHECKOUT",
                        help="another checkout of this project: its emulated job as a third side")
    parser.add_argument("--count-calls", action="store_true",
                        help="count Python calls per step (one job per side) instead of timing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    args.against = checkout_argument(parser, args.against)
    sides = ("cpu", "supa") + (("base",) if args.against else ())
    print(f"{WORLD} ranks, {args.layers}x{args.width} MLP, bf16, Adam, micro batch {args.batch}" +
          ("" if args.count_calls else
           f"; median of {args.steps} steps after {args.warmup}, {args.rounds} rounds per side"))
    if args.against:
        print(f"supa: {ROOT} ({commit(ROOT)}); base: {args.against} ({commit(args.against)})")
    print(f"at start: {load()}")
    if args.count_calls:
        _print_calls(args, sides)
        return
    times = {side: {s: [] for s in args.stages} for side in sides}
    for round_index in range(args.rounds):
        shift = round_index % len(sides)  # each side goes first in turn: a load drift hits all alike
        for side in sides[shift:] + sides[:shift]:
            for stage, seconds in _run_job(side, args).items():
                times[side][stage].append(seconds)
    median = {side: {s: statistics.median(times[side][s]) for s in args.stages} for side in sides}
    header = f"{'ZeRO stage':<12}{'cpu accel':>12}{'emulated supa':>16}{'supa/cpu':>10}"
    if args.against:
        header += f"{'base':>12}{'supa/base':>11}   per-round supa/base"
    else:
        header += "   per-round supa/cpu"
    print(header)
    for stage in args.stages:
        cpu, supa = median["cpu"][stage], median["supa"][stage]
        line = f"{stage:<12}{cpu * 1e3:>9.2f} ms{supa * 1e3:>13.2f} ms{supa / cpu:>9.2f}x"
        reference = "base" if args.against else "cpu"
        if args.against:
            line += f"{median['base'][stage] * 1e3:>9.2f} ms{supa / median['base'][stage]:>10.2f}x"
        rounds = " ".join(f"{s / r:.2f}" for r, s in zip(times[reference][stage], times["supa"][stage]))
        print(f"{line}   {rounds}")
    print(f"at end: {load()}")


if __name__ == "__main__":
    main()
