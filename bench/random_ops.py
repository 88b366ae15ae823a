"""The card's random operators (Philox, csrc/aten/random_ops.cpp) against PyTorch's CPU ones.

Run: SUPA_EMULATE=1 python bench/random_ops.py [--mib 64] [--rounds 7]

Each operator fills a float32 tensor of --mib MiB on supa:0 and on the CPU in the same process, the
two sides taking turns round by round; the median seconds per call are reported with
ratio = CPU time / supa time (above 1: the card's kernel is faster). The numbers differ between the
sides (a card's are not the CPU's); only the time is compared. Read the ratios, not the absolute
times: the load average at start and end is printed with them.
"""

import argparse
import statistics
import time

import torch

from harness import load, require_supa

OPERATORS = {
    "uniform_": lambda t: t.uniform_(),
    "normal_": lambda t: t.normal_(),
    "bernoulli_(0.5)": lambda t: t.bernoulli_(0.5),
    "exponential_": lambda t: t.exponential_(),
    "random_(0, 1000)": lambda t: t.random_(0, 1000),
    "dropout(0.1)": lambda t: torch.nn.functional.dropout(t, 0.1),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    require_supa()
    numel = args.mib * 2**20 // 4
    print(f"{numel} float32 elements per call, {args.rounds} rounds, {torch.get_num_threads()} threads; {load()}")
    tensors = {"cpu": torch.empty(numel), "supa": torch.empty(numel, device="supa")}
    print(f"{'operator':<18} {'cpu s':>8} {'supa s':>8} {'ratio':>6}")
    for name, op in OPERATORS.items():
        times = {side: [] for side in tensors}
        for side, t in tensors.items():
            op(t)  # warm: first-touch page faults, allocator caches
        for _ in range(args.rounds):
            for side, t in tensors.items():
                start = time.perf_counter()
                op(t)
                times[side].append(time.perf_counter() - start)
        cpu, supa = (statistics.median(times[side]) for side in ("cpu", "supa"))
        print(f"{name:<18} {cpu:8.3f} {supa:8.3f} {cpu / supa:6.2f}")
    print(load())


if __name__ == "__main__":
    main()
