"""What torch.profiler's card track costs: a profiled training step with and without the device activity.

    SUPA_EMULATE=1 python bench/profiler_card_time.py [--rounds 20] [--width 256]

Each round profiles one step of a small MLP on supa (forward, backward, SGD) twice, once with
`activities=[CPU]` and once with `[CPU, PrivateUse1]` (the card track: each launch recorded, then
costed and placed when the profile stops), in alternating order, and times the whole `with
profile(...)` block including its processing. Printed: each side's median seconds, their ratio
(card track / host only), the launches on the card track and its modelled card time against the
host's time for the step.
"""

import argparse
import os
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def _step(model, optimizer, batch):
    optimizer.zero_grad()
    model(batch).square().mean().backward()
    optimizer.step()


def _profiled(model, optimizer, batch, activities) -> tuple:
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        _step(model, optimizer, batch)
    return time.perf_counter() - start, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)]).to("supa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(64, args.width, device="supa")
    host = [ProfilerActivity.CPU]
    card = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]
    for _ in range(2):  # warm: first profiles initialise Kineto
        _profiled(model, optimizer, batch, host)
        _profiled(model, optimizer, batch, card)
    times = {"host": [], "card": []}
    for i in range(args.rounds):
        for side in (("host", "card") if i % 2 == 0 else ("card", "host")):
            seconds, prof = _profiled(model, optimizer, batch, host if side == "host" else card)
            times[side].append(seconds)
            if side == "card":
                kernels = [e for e in prof.events() if e.device_type == DeviceType.PrivateUse1]
    host_s, card_s = statistics.median(times["host"]), statistics.median(times["card"])
    card_us = sum(e.time_range.elapsed_us() for e in kernels)
    print(f"profiled step, median of {args.rounds}: host only {host_s * 1e3:.2f} ms, with the card track "
          f"{card_s * 1e3:.2f} ms, ratio {card_s / host_s:.3f}")
    print(f"card track: {len(kernels)} launches, {card_us:.1f} us of modelled card time "
          f"(the step took {card_s * 1e6:.0f} us on this host)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
