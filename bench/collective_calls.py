"""Python function calls per bccl collective, 2 ranks, the collectives of the DeepSpeed step (bench/deepspeed_step.py).

    SUPA_EMULATE=1 python bench/collective_calls.py [--calls 200]
    SUPA_EMULATE=1 python bench/collective_calls.py --against CHECKOUT

A count of the Python-level calls on the calling thread does not depend on the machine's load, as
step times do: it measures the interpreter work bccl adds to each collective. Each rank issues the
collectives a ZeRO-2 and a ZeRO-3 step of that bench issue (a bf16 gradient bucket's all_reduce,
the scalar all_reduces of the overflow check and the gradient norm, a reduce_scatter_tensor of a
gradient partition, a large and a small all_gather_into_tensor), each through
torch.distributed's function and waited for, first unprofiled, then --calls times under
`sys.setprofile`, which counts every Python function call on rank 0's main thread: in all, and
those whose code lives in supa_emu (the rest is torch.distributed's wrapper, equal on both sides).
The median microseconds of an unprofiled call are printed beside them (load-dependent).

--against CHECKOUT counts the same in a fresh interpreter running another checkout of this
project (as bench/deepspeed_step.py --against does) and prints both side by side.
"""

import argparse
import collections
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import ROOT, checkout_argument, checkout_env, commit, load, running_checkout

WORLD = 2
MARK = "COLLECTIVE_CALLS "

# (label, collective, dtype, elements of the tensor it reduces or gathers into / of its input),
# the sizes a 4x512 MLP's step issues with DeepSpeed's 500,000-element buckets.
CASES = (
    ("all_reduce bf16 263k", "all_reduce", torch.bfloat16, 263168),
    ("all_reduce fp32 1", "all_reduce", torch.float32, 1),
    ("all_reduce uint8 1 MAX", "all_reduce", torch.uint8, 1),
    ("reduce_scatter bf16 263k", "reduce_scatter_tensor", torch.bfloat16, 262656),
    ("all_gather bf16 1M", "all_gather_into_tensor", torch.bfloat16, 1050624),
    ("all_gather bf16 512", "all_gather_into_tensor", torch.bfloat16, 512),
)


def _issue(collective: str, tensors, reduce_op) -> None:
    if collective == "all_reduce":
        dist.all_reduce(tensors[0], op=reduce_op)
    elif collective == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(tensors[0], tensors[1])
    else:
        dist.all_gather_into_tensor(tensors[0], tensors[1])


def _tensors(collective: str, dtype, numel: int, device):
    if collective == "all_reduce":
        return (torch.ones(numel, dtype=dtype, device=device),)
    if collective == "reduce_scatter_tensor":
        return torch.empty(numel // WORLD, dtype=dtype, device=device), torch.ones(numel, dtype=dtype, device=device)
    return torch.empty(numel, dtype=dtype, device=device), torch.ones(numel // WORLD, dtype=dtype, device=device)


class _Counter:
    """Counts Python function calls (all, and those in supa_emu's files, by function) on this thread."""

    def __init__(self, package: str):
        self.package = package
        self.total = 0
        self.by_file = collections.Counter()

    def __call__(self, frame, event, arg):
        if event == "call":
            self.total += 1
            filename = frame.f_code.co_filename
            if filename.startswith(self.package):
                self.by_file[f"{filename[len(self.package):]}:{frame.f_code.co_name}"] += 1


def _worker(rank: int, port: int, calls: int, queue) -> None:
    torch.set_num_threads(1)
    torch.accelerator.set_device_index(rank)
    dist.init_process_group("bccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    device = torch.device("supa", rank)
    import supa_emu

    package = str(pathlib.Path(supa_emu.__file__).resolve().parent) + os.sep
    rows = []
    for label, collective, dtype, numel in CASES:
        tensors = _tensors(collective, dtype, numel, device)
        reduce_op = dist.ReduceOp.MAX if dtype == torch.uint8 else dist.ReduceOp.SUM
        seconds = []
        for _ in range(calls):  # warm-up and timing, unprofiled
            start = time.perf_counter()
            _issue(collective, tensors, reduce_op)
            seconds.append(time.perf_counter() - start)
        counter = _Counter(package)
        sys.setprofile(counter)
        for _ in range(calls):
            _issue(collective, tensors, reduce_op)
        sys.setprofile(None)
        rows.append({"case": label, "calls": counter.total / calls,
                     "supa_emu": sum(counter.by_file.values()) / calls,
                     "by_file": {name: count / calls for name, count in counter.by_file.most_common()},
                     "us": statistics.median(seconds) * 1e6})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _rows(calls: int) -> list:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(port, calls, queue), nprocs=WORLD)
    return queue.get()


def _job(args) -> list:
    """The rows counted in a fresh interpreter running `args.against`'s supa_emu."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--job", "--calls", str(args.calls)]
    result = subprocess.run(command, cwd=ROOT, env=checkout_env(dict(os.environ), args.against),
                            capture_output=True, text=True, timeout=1800)
    lines = [line[len(MARK):] for line in result.stdout.splitlines() if line.startswith(MARK)]
    if result.returncode != 0 or len(lines) != 1:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-8000:])
        raise SystemExit(f"the job of {args.against} failed (exit code {result.returncode})")
    job = json.loads(lines[0])
    if job["checkout"] != str(args.against):
        raise SystemExit(f"the job ran the checkout {job['checkout']}, not {args.against}")
    return job["rows"]


def _print(rows, base=None) -> None:
    header = f"{'collective':<26}{'calls':>8}{'supa_emu':>10}{'us':>9}"
    if base is not None:
        header += f"{'base calls':>12}{'supa_emu':>10}{'us':>9}"
    print(header)
    for index, row in enumerate(rows):
        line = f"{row['case']:<26}{row['calls']:>8.1f}{row['supa_emu']:>10.1f}{row['us']:>9.0f}"
        if base is not None:
            other = base[index]
            line += f"{other['calls']:>12.1f}{other['supa_emu']:>10.1f}{other['us']:>9.0f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="profiled calls per collective (as many unprofiled)")
    parser.add_argument("--by-file", action="store_true", help="also the supa_emu calls per function")
    parser.add_argument("--against", type=pathlib.Path, metavar="CHECKOUT",
                        help="another checkout of this project, counted in a fresh interpreter, side by side")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.against = checkout_argument(parser, args.against)
    if args.job:
        print(MARK + json.dumps({"checkout": running_checkout(), "rows": _rows(args.calls)}))
        return
    print(f"Python calls per collective on rank 0's calling thread, {WORLD} ranks, {args.calls} calls each; "
          f"us: median unprofiled call ({load()})")
    print(f"supa: {ROOT} ({commit(ROOT)})" + (f"; base: {args.against} ({commit(args.against)})"
                                              if args.against else ""))
    rows = _rows(args.calls)
    _print(rows, _job(args) if args.against is not None else None)
    if args.by_file:
        for row in rows:
            print(f"{row['case']}: " + ", ".join(f"{name} {count:.1f}" for name, count in row["by_file"].items()))


if __name__ == "__main__":
    if os.environ.get("SUPA_EMULATE") != "1":
        sys.exit("run with SUPA_EMULATE=1 (the benchmark needs emulated supa devices)")
    main()
