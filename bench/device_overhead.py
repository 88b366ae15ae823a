"""What the emulated `supa` device costs over plain CPU tensors, measured side by side.

Run: SUPA_EMULATE=1 python bench/device_overhead.py

Each workload runs on CPU tensors and on supa tensors in the same process, alternating
rounds, and the median times are compared. Machines are noisy: read the ratios, not the
absolute times. Targets: <= 1.1x on the training steps and the large op.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_seconds(fn, rounds: int, inner: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def compare(make_workload, rounds: int, inner: int) -> tuple[float, float]:
    """Median seconds per call on CPU and on supa, measured in alternating rounds."""
    cpu_fn, supa_fn = make_workload("cpu"), make_workload("supa")
    cpu_fn(), supa_fn()  # warm up allocators and caches
    cpu, supa = [], []
    for _ in range(rounds):
        cpu.append(_median_seconds(cpu_fn, 1, inner))
        supa.append(_median_seconds(supa_fn, 1, inner))
    return statistics.median(cpu), statistics.median(supa)


def mlp_step(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256, device=device), torch.randn(64, 256, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return step


def transformer_step(device: str):
    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True,
                                             dropout=0.0).to(device)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-3)
    x = torch.randn(8, 64, 256, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        block(x).pow(2).mean().backward()
        opt.step()
    return step


def tiny_inplace_ops(device: str):
    t = torch.zeros(16, device=device)

    def run():
        for _ in range(100):
            t.add_(1.0)
    return run


def large_elementwise(device: str):
    a = torch.randn(16 * 1024 * 1024, device=device)
    b = torch.randn(16 * 1024 * 1024, device=device)

    def run():
        torch.add(a, b, alpha=0.5)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not (hasattr(torch, "supa") and torch.supa.is_available()):
        raise SystemExit("no supa device: run with SUPA_EMULATE=1")
    torch.set_num_threads(torch.get_num_threads())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} alternating rounds")
    print(f"{'workload':<44}{'cpu':>12}{'supa':>12}{'supa/cpu':>10}")
    rows = [
        ("MLP train step (256-1024-256, batch 64)", mlp_step, 20, "ms"),
        ("transformer block train step (d=256, seq 64)", transformer_step, 5, "ms"),
        ("100 tiny in-place ops (add_ on 16 floats)", tiny_inplace_ops, 20, "us/op"),
        ("large elementwise add (16M floats)", large_elementwise, 5, "ms"),
    ]
    for name, workload, inner, unit in rows:
        cpu, supa = compare(workload, args.rounds, inner)
        scale = 1e6 / 100 if unit == "us/op" else 1e3
        print(f"{name:<44}{cpu * scale:>9.2f} {unit:<3}{supa * scale:>8.2f} {unit:<3}{supa / cpu:>8.2f}x")
        if unit == "us/op":
            print(f"{'  emulation overhead per op':<44}{(supa - cpu) * scale:>21.2f} us")


if __name__ == "__main__":
    main()
