"""What the stream sanitizer (torch.supa._sanitizer) and the memory checker (torch.supa._memcheck)
cost on a training step, measured side by side.

Run: SUPA_EMULATE=1 python bench/sanitizer.py [--checkers streams memory streams,memory]

Each workload is built once on the supa device and timed in alternating rounds with the
checker off and on (same process, same tensors); the medians are compared. Target: < 3x.
Machines are noisy: read the ratios; the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from device_overhead import _seconds_per_call, cnn_step, mlp_step, transformer_step
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


def _switch(checkers: str):
    """(enable, disable) for a comma-joined list of checkers, as SUPA_EMU_SANITIZE names them."""
    from torch.supa import _memcheck, _sanitizer

    on = {"streams": (_sanitizer.enable_supa_sanitizer, _sanitizer.disable_supa_sanitizer),
          "memory": (_memcheck.enable_memory_checker, _memcheck.disable_memory_checker)}
    chosen = [on[name] for name in checkers.split(",")]

    def enable():
        for start, _ in chosen:
            start()

    def disable():
        for _, stop in reversed(chosen):
            stop()
    return enable, disable


def compare(make_workload, rounds: int, inner: int, checkers: str = "streams") -> tuple[float, float]:
    """Median seconds per call with the checkers off and on, measured in alternating rounds."""
    enable, disable = _switch(checkers)
    fn = make_workload("supa")
    fn()  # warm up allocator and caches
    enable()
    fn()  # ... and the checkers' per-operator schema caches
    disable()
    off, on = [], []
    for _ in range(rounds):
        torch.supa.synchronize()
        off.append(_seconds_per_call(fn, inner))
        enable()  # a fresh history each round: nothing to carry over
        try:
            on.append(_seconds_per_call(fn, inner))
        finally:
            disable()
    return statistics.median(off), statistics.median(on)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--checkers", nargs="+", default=["streams", "memory", "streams,memory"],
                        help="what to switch on per row, as SUPA_EMU_SANITIZE names it")
    args = parser.parse_args()
    require_supa()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.rounds} alternating "
          f"rounds; at start: {load()}")
    print(f"{'workload':<52}{'checker':<16}{'off':>10}{'on':>10}{'on/off':>9}")
    rows = [
        ("MLP train step (256-1024-256, batch 64)", mlp_step, 20),
        ("MLP step + pinned prefetch on a side stream", side_stream_step, 20),
        ("transformer block train step (d=256, seq 64)", transformer_step, 5),
        ("small CNN train step (2 conv, 32x32, batch 32)", cnn_step, 5),
    ]
    for name, workload, inner in rows:
        for checkers in args.checkers:
            off, on = compare(workload, args.rounds, inner, checkers)
            print(f"{name:<52}{checkers:<16}{off * 1e3:>7.2f} ms{on * 1e3:>7.2f} ms{on / off:>8.2f}x")
    print(f"at end: {load()}")


if __name__ == "__main__":
    main()
