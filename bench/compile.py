"""What torch.compile gains on emulated supa cards compared with what it gains on the CPU.

Run: SUPA_EMULATE=1 python bench/compile.py

One small transformer block training step (forward, backward, AdamW) runs eagerly and compiled
(torch.compile of the block; Inductor's C++ kernels), on CPU tensors and on supa tensors, in
the same process, in alternating rounds. The speedup is eager time / compiled time on each
device; the ratio of the two speedups says whether compiling pays off on the emulated card as
much as on the CPU (target: >= 0.9x). Machines are noisy: read the ratios; the load average
is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from harness import load, require_supa


def training_step(block: torch.nn.Module, device: str, compiled: bool):
    """A closure running one training step of (a copy of) `block` on `device`."""
    model = copy.deepcopy(block).to(device)
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 32, model.linear1.in_features, generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        forward(x).square().mean().backward()
        optimizer.step()
    return step


def seconds_per_step(step, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        step()
    return (time.perf_counter() - start) / inner



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=10, help="steps timed per round")
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    require_supa()

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; at start: {load()}")
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(d_model=args.dim, nhead=4, dim_feedforward=4 * args.dim,
                                             dropout=0.0, batch_first=True)
    variants = {(device, compiled): training_step(block, device, compiled)
                for device in ("cpu", "supa") for compiled in (False, True)}
    compile_start = time.perf_counter()
    for step in variants.values():
        for _ in range(3):  # compiles (forward and backward graphs) and warms up allocators
            step()
    print(f"warm-up including compilation: {time.perf_counter() - compile_start:.1f} s")

    samples: dict[tuple[str, bool], list[float]] = {key: [] for key in variants}
    for _ in range(args.rounds):
        for key, step in variants.items():
            samples[key].append(seconds_per_step(step, args.inner))
    median = {key: statistics.median(values) for key, values in samples.items()}

    print(f"transformer block train step (d={args.dim}, seq 32, batch 8), median of {args.rounds} rounds "
          f"x {args.inner} steps")
    print(f"{'device':<8}{'eager':>12}{'compiled':>12}{'speedup':>10}")
    speedup = {}
    for device in ("cpu", "supa"):
        eager, compiled = median[device, False], median[device, True]
        speedup[device] = eager / compiled
        print(f"{device:<8}{eager * 1e3:>9.2f} ms{compiled * 1e3:>9.2f} ms{speedup[device]:>9.2f}x")
    print(f"supa speedup / cpu speedup: {speedup['supa'] / speedup['cpu']:.2f} (target >= 0.90)")
    print(f"at end: {load()}")


if __name__ == "__main__":
    main()
