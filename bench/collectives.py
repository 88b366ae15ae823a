"""Bus bandwidth of bccl on supa tensors against raw gloo on CPU tensors, 2 ranks, 1 KiB to 64 MiB;
then torch.supa.bccl.all_reduce in one process over 2 and 8 cards against torch.stack(...).sum(0).

    SUPA_EMULATE=1 python bench/collectives.py [--max-mib 64] [--world 2] [--part all|ranks|cards]
    SUPA_EMULATE=1 python bench/collectives.py --against CHECKOUT [--rounds 3]

Each rank runs both sides in the same process (bccl as the default group, a gloo group from
new_group). The two sides take turns call by call (up to 400 calls each per size), and rank 0's
median call time per side is reported, so bursts of machine noise hit both alike and single
outliers do not count; the machine's load average is printed at start and end. Bus bandwidth follows the
nccl-tests convention, with S the size of the full tensor (all_reduce buffer, all_gather output,
reduce_scatter input) and n the world size:
all_reduce S*2(n-1)/n/t, all_gather_into_tensor and reduce_scatter_tensor S*(n-1)/n/t.

The single-process part (64 KiB to --max-mib per card) times `torch.supa.bccl.all_reduce` of one
float32 buffer per card, in place, against the copy bound of the same reduction on the host:
`torch.stack(buffers).sum(0)` over as many CPU buffers, which copies every buffer once and sums
(and leaves the result in one place, where bccl also writes it to every card). The plain call
allocates its stack and result every time (page faults on first touch from a few MiB on), so a
second reference stacks and sums into buffers allocated once (`out=`). The sides take turns call
by call in this process, on one thread (as each rank above: with a thread team, an overloaded
2-core machine times the scheduler, not the copies); ratio = reference time / bccl time (above 1:
bccl is faster).

--against CHECKOUT runs the ranks part from this checkout and from another one (its supa_emu first
on the path, as bench/deepspeed_step.py --against does), in fresh interpreters, jobs alternating,
and prints bccl's bandwidth per side (median over jobs) and supa/base (above 1: this checkout is
faster); then bccl over gloo within each job, where the two took turns call by call, per side and
their ratio: the same comparison with the machine's drift between jobs divided out.
"""

import argparse
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

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
SECONDS_PER_SIZE = 1.2  # per collective and size, both sides together
MIN_CALLS, MAX_CALLS = 25, 400  # at least 25: with 9, the 16-64 MiB cells moved by 0.1 between runs


def _buffers(name: str, nbytes: int, world: int, device: torch.device):
    numel = max(world, nbytes // 4 // world * world)
    if name == "all_reduce":
        return (torch.ones(numel, device=device),)
    if name == "all_gather_into_tensor":
        return torch.empty(numel, device=device), torch.ones(numel // world, device=device)
    return torch.empty(numel // world, device=device), torch.ones(numel, device=device)


def _run(name: str, buffers, group) -> None:
    if name == "all_reduce":
        dist.all_reduce(buffers[0], group=group)
    elif name == "all_gather_into_tensor":
        dist.all_gather_into_tensor(buffers[0], buffers[1], group=group)
    else:
        dist.reduce_scatter_tensor(buffers[0], buffers[1], group=group)


def _bus_bytes(name: str, nbytes: int, world: int) -> float:
    factor = 2 * (world - 1) / world if name == "all_reduce" else (world - 1) / world
    return nbytes * factor


def _calls(name, buffers, group, sync_group) -> int:
    """Enough interleaved call pairs to last about SECONDS_PER_SIZE (agreed across ranks)."""
    _run(name, buffers, group)
    start = time.perf_counter()
    _run(name, buffers, group)
    estimate = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=sync_group)
    return max(MIN_CALLS, min(MAX_CALLS, int(SECONDS_PER_SIZE / 2 / max(estimate.item(), 1e-6))))


def _median_seconds(name, sides, calls: int) -> list:
    """Median time of one call per side; the sides take turns call by call, first one then the
    other, so any burst of machine noise lands on both alike."""
    samples = [[] for _ in sides]
    for call in range(calls):
        order = range(len(sides)) if call % 2 == 0 else reversed(range(len(sides)))
        for index in order:
            buffers, group = sides[index]
            start = time.perf_counter()
            _run(name, buffers, group)
            samples[index].append(time.perf_counter() - start)
    return [statistics.median(side) for side in samples]


def _worker(rank: int, world: int, port: int, sizes, queue) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores with gloo's threads
    torch.accelerator.set_device_index(rank)
    dist.init_process_group("bccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    device = torch.device("supa", rank)
    rows = []
    for name in COLLECTIVES:
        for nbytes in sizes:
            supa_buffers = _buffers(name, nbytes, world, device)
            cpu_buffers = _buffers(name, nbytes, world, torch.device("cpu"))
            calls = _calls(name, cpu_buffers, gloo, gloo)
            _calls(name, supa_buffers, None, gloo)  # warm-up
            dist.barrier(group=gloo)
            gloo_s, bccl_s = _median_seconds(name, [(cpu_buffers, gloo), (supa_buffers, None)], calls)
            size = supa_buffers[0].numel() * 4 if name != "reduce_scatter_tensor" else supa_buffers[1].numel() * 4
            rows.append((name, size, _bus_bytes(name, size, world) / bccl_s, _bus_bytes(name, size, world) / gloo_s))
            del supa_buffers, cpu_buffers
    if rank == 0:
        queue.put(rows)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def _size_label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


CARD_COUNTS = (2, 8)


def _single_process_rows(max_mib: int) -> list:
    """(cards, bytes per card, bccl, stack-sum, preallocated stack-sum seconds) per card count and size."""
    torch.set_num_threads(1)
    rows = []
    for cards in CARD_COUNTS:
        nbytes = 64 << 10
        while nbytes <= max_mib << 20:
            numel = nbytes // 4
            on_cards = [torch.ones(numel, device=torch.device("supa", index)) for index in range(cards)]
            on_host = [torch.ones(numel) for _ in range(cards)]
            stacked, summed = torch.empty(cards, numel), torch.empty(numel)
            sides = [lambda: torch.supa.bccl.all_reduce(on_cards), lambda: torch.stack(on_host).sum(0),
                     lambda: torch.sum(torch.stack(on_host, out=stacked), 0, out=summed)]
            for side in sides:  # warm-up, and the call count that lasts about SECONDS_PER_SIZE
                side()
            start = time.perf_counter()
            sides[1]()
            calls = max(MIN_CALLS, min(MAX_CALLS, int(SECONDS_PER_SIZE / 3 / max(time.perf_counter() - start, 1e-6))))
            samples = [[] for _ in sides]
            for call in range(calls):
                for index in (range(len(sides)) if call % 2 == 0 else reversed(range(len(sides)))):
                    start = time.perf_counter()
                    sides[index]()
                    samples[index].append(time.perf_counter() - start)
            rows.append((cards, nbytes, *(statistics.median(side) for side in samples)))
            del on_cards, on_host, stacked, summed
            nbytes *= 4
    return rows


def _print_single_process(rows) -> None:
    print(f"torch.supa.bccl.all_reduce (float32, in place, one process) vs torch.stack(...).sum(0) on the host, "
          f"{torch.get_num_threads()} threads, median of interleaved calls")
    print(f"{'cards':>5}{'size/card':>11}{'bccl ms':>10}{'stack ms':>10}{'ratio':>8}{'out= ms':>10}{'ratio':>8}")
    for cards, nbytes, bccl_s, stack_s, out_s in rows:
        print(f"{cards:>5}{_size_label(nbytes):>11}{bccl_s * 1e3:>10.3f}{stack_s * 1e3:>10.3f}{stack_s / bccl_s:>8.2f}"
              f"{out_s * 1e3:>10.3f}{out_s / bccl_s:>8.2f}")


def _ranks_rows(world: int, max_mib: int) -> list:
    """(collective, bytes, bccl B/s, gloo B/s) per collective and size, as rank 0 measured them."""
    sizes, nbytes = [], 1 << 10
    while nbytes <= max_mib << 20:
        sizes.append(nbytes)
        nbytes *= 4
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, port, sizes, queue), nprocs=world)
    return queue.get()


def _print_ranks(rows, world: int) -> None:
    print(f"bus bandwidth, {world} ranks, torch {torch.__version__} "
          f"(bccl: supa tensors; gloo: CPU tensors; median of interleaved calls, rank 0)")
    print(f"{'collective':<24}{'size':>9}{'bccl GB/s':>12}{'gloo GB/s':>12}{'ratio':>8}")
    for name, size, bccl_bw, gloo_bw in rows:
        print(f"{name:<24}{_size_label(size):>9}{bccl_bw / 1e9:>12.3f}{gloo_bw / 1e9:>12.3f}{bccl_bw / gloo_bw:>8.2f}")


# ------------------------------------------------------------------------------------------------
# --against: the ranks part run from this checkout and from another one, jobs alternating
# ------------------------------------------------------------------------------------------------
MARK = "COLLECTIVES_ROWS "  # a --job's result line starts with this


def _job(side: str, args) -> dict:
    """One run of the ranks part in a fresh interpreter; bccl from `side`'s checkout."""
    env = dict(os.environ)
    if side == "base":
        env = checkout_env(env, args.against)
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--job",
               "--world", str(args.world), "--max-mib", str(args.max_mib)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line[len(MARK):] for line in result.stdout.splitlines() if line.startswith(MARK)]
    if result.returncode != 0 or len(lines) != 1:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-8000:])
        raise SystemExit(f"the {side} job failed (exit code {result.returncode})")
    job = json.loads(lines[0])
    expected = str(args.against if side == "base" else ROOT)
    if job["checkout"] != expected:
        raise SystemExit(f"the {side} job ran the checkout {job['checkout']}, not {expected}")
    return {(name, size): (bccl_bw, gloo_bw) for name, size, bccl_bw, gloo_bw in job["rows"]}


def _compare(args) -> None:
    sides = ("supa", "base")
    print(f"bccl bus bandwidth, {args.world} ranks: this checkout (supa) against another (base), "
          f"{args.rounds} jobs per side, alternating")
    print(f"supa: {ROOT} ({commit(ROOT)}); base: {args.against} ({commit(args.against)})")
    print(f"at start: {load()}")
    jobs = {side: [] for side in sides}
    for round_index in range(args.rounds):
        for side in sides if round_index % 2 == 0 else reversed(sides):  # a load drift hits both alike
            jobs[side].append(_job(side, args))
    print(f"{'collective':<24}{'size':>9}{'supa GB/s':>11}{'base GB/s':>11}{'supa/base':>11}"
          f"{'bccl/gloo: supa':>17}{'base':>7}{'ratio':>8}")
    for name, size in jobs["supa"][0]:
        bccl = {side: statistics.median(job[name, size][0] for job in jobs[side]) for side in sides}
        # bccl over gloo in each job (the two took turns call by call there), median over jobs
        to_gloo = {side: statistics.median(job[name, size][0] / job[name, size][1] for job in jobs[side])
                   for side in sides}
        print(f"{name:<24}{_size_label(size):>9}{bccl['supa'] / 1e9:>11.3f}{bccl['base'] / 1e9:>11.3f}"
              f"{bccl['supa'] / bccl['base']:>10.2f}x{to_gloo['supa']:>17.2f}{to_gloo['base']:>7.2f}"
              f"{to_gloo['supa'] / to_gloo['base']:>7.2f}x")
    print(f"at end: {load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--part", choices=("all", "ranks", "cards"), default="all",
                        help="ranks: bccl vs gloo across processes; cards: torch.supa.bccl in one process")
    parser.add_argument("--against", type=pathlib.Path, metavar="CHECKOUT",
                        help="another checkout of this project: the ranks part from both, side by side")
    parser.add_argument("--rounds", type=int, default=3, help="with --against: jobs per side (alternating)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.against = checkout_argument(parser, args.against)
    if args.job:
        print(MARK + json.dumps({"checkout": running_checkout(), "rows": _ranks_rows(args.world, args.max_mib)}))
        return
    if args.against is not None:
        if args.part != "all":
            parser.error("--against compares the ranks part; leave --part out")
        _compare(args)
        return
    if args.part != "ranks" and torch.supa.device_count() < max(CARD_COUNTS):
        sys.exit(f"the single-process part needs {max(CARD_COUNTS)} cards (SUPA_EMU_DEVICE_COUNT)")
    print(f"at start: {load()}")
    if args.part != "cards":
        _print_ranks(_ranks_rows(args.world, args.max_mib), args.world)
    if args.part != "ranks":
        _print_single_process(_single_process_rows(args.max_mib))
    print(f"at end: {load()}")


if __name__ == "__main__":
    if os.environ.get("SUPA_EMULATE") != "1":
        sys.exit("run with SUPA_EMULATE=1 (the benchmark needs emulated supa devices)")
    main()
