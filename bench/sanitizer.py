"""What the stream sanitizer (torch.supa._sanitizer) costs on a training step, measured side by side.

Run: SUPA_EMULATE=1 python bench/sanitizer.py

Each workload is built once on the supa device and timed in alternating rounds with the
sanitizer off and on (same process, same tensors); the medians are compared. Target: < 3x.
Machines are noisy: read the ratios; the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from device_overhead import _median_seconds, cnn_step, mlp_step, transformer_step
from harness import load, require_supa



def side_stream_step(device: str):
    """An MLP step whose next batch is copied from pinned memory on a side stream (prefetch),
    ordered with wait_stream and record_stream as training loops do: events and waits tracked too."""
    step = mlp_step(device)
    copy_stream = torch.supa.Stream()
    host = torch.randn(64, 256).pin_memory()

    def run():
        with torch.supa.stream(copy_stream):
            batch = host.to(device, non_blocking=True)
        torch.supa.current_stream().wait_stream(copy_stream)
        batch.record_stream(torch.supa.current_stream())
        step()
        batch.mul_(2)
    return run


def compare(make_workload, rounds: int, inner: int) -> tuple[float, float]:
    """Median seconds per call with the sanitizer off and on, measured in alternating rounds."""
    from torch.supa import _sanitizer

    fn = make_workload("supa")
    fn()  # warm up allocator and caches
    _sanitizer.enable_supa_sanitizer()
    fn()  # ... and the sanitizer's per-operator schema cache
    _sanitizer.disable_supa_sanitizer()
    off, on = [], []
    for _ in range(rounds):
        torch.supa.synchronize()
        off.append(_median_seconds(fn, 1, inner))
        _sanitizer.enable_supa_sanitizer()  # a fresh history each round: nothing to carry over
        try:
            on.append(_median_seconds(fn, 1, inner))
        finally:
            _sanitizer.disable_supa_sanitizer()
    return statistics.median(off), statistics.median(on)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    require_supa()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} alternating "
          f"rounds; at start: {load()}")
    print(f"{'workload':<52}{'off':>10}{'on':>10}{'on/off':>9}")
    rows = [
        ("MLP train step (256-1024-256, batch 64)", mlp_step, 20),
        ("MLP step + pinned prefetch on a side stream", side_stream_step, 20),
        ("transformer block train step (d=256, seq 64)", transformer_step, 5),
        ("small CNN train step (2 conv, 32x32, batch 32)", cnn_step, 5),
    ]
    for name, workload, inner in rows:
        off, on = compare(workload, args.rounds, inner)
        print(f"{name:<52}{off * 1e3:>7.2f} ms{on * 1e3:>7.2f} ms{on / off:>8.2f}x")
    print(f"at end: {load()}")


if __name__ == "__main__":
    main()
