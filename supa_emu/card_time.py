"""The emulated card's time in torch.profiler: each supa launch for the time the card would take.

A profile that asks for the device activity (`ProfilerActivity.PrivateUse1`, or `CUDA` under the
transfer) gets a track per stream of each card on which every launch the program made runs for
its modelled time: the planner's cost model (plan/op_costs.py: FLOPs and bytes from the shapes
and dtypes; plan/time_model.launch_seconds: the card profile's peaks and the efficiency curves).
The native side (csrc/runtime/card_time_profiler.cpp) records the launches while the profile runs
and calls `_Placement` when it is processed. On its stream a launch starts once the host began
it and the stream's previous kernel ended, after the card's launch latency, so the track is what
the card would show behind this host; the host's own times are the emulator's.

The profiler without Kineto (torch.autograd.profiler.profile with use_kineto=False) asks the same
native side for each operator's device time between two events: the sum of these placements'
durations for the launches made in between.

The card is SUPA_EMU_PROFILER_CARD's, by default the emulated card's (SUPA_EMU_PROFILE).
"""

from __future__ import annotations

import warnings

from supa_emu import card_profiles, process_state

NS = 1e9
KERNEL_PREFIX = "card:"  # a kernel's name: the operator's with this prefix (its own row in tables)


class _Placement:
    """Places one profile's launches on the card's streams: [(operator, device, stream, host start ns,
    host end ns, inputs, outputs)] -> per launch None (launches nothing) or (name, "kernel"|"memcpy",
    start ns, end ns, FLOPs, bytes)."""

    def __init__(self, profile: card_profiles.CardProfile):
        self.profile = profile

    def __call__(self, launches: list) -> list:
        from supa_emu.plan import op_costs, time_model

        ready: dict = {}  # (device, stream) -> ns when the stream's last kernel ends
        latency = round(self.profile.launch_latency * NS)
        placed, untimed = [], set()
        for name, device, stream, host_start, _host_end, ins, outs in launches:
            try:
                cost = op_costs.cost(name, ins, outs)
            except Exception:  # operands the cost model cannot read: named below, not guessed
                untimed.add(name)
                placed.append(None)
                continue
            if cost.kind == "none":
                placed.append(None)
                continue
            busy = round(max(time_model.launch_seconds(self.profile, cost)) * NS)
            start = max(host_start, ready.get((device, stream), 0)) + latency
            ready[(device, stream)] = start + busy
            placed.append((_kernel_name(name, cost.kind), "memcpy" if cost.kind in ("h2d", "d2h") else "kernel",
                           start, start + busy, round(cost.flops), round(cost.bytes)))
        if untimed:
            warnings.warn(f"supa_emu: the profiler's card track leaves out {', '.join(sorted(untimed))}: "
                          f"the card's cost model cannot read their operands", RuntimeWarning, stacklevel=1)
        return placed


def _kernel_name(operator: str, kind: str) -> str:
    if kind == "h2d":
        return KERNEL_PREFIX + "Memcpy HtoD"
    if kind == "d2h":
        return KERNEL_PREFIX + "Memcpy DtoH"
    return KERNEL_PREFIX + operator.partition(".")[0]


def install(profile: card_profiles.CardProfile) -> None:
    """Give torch.profiler's device activity the card track, timed on `profile` (and the profiler
    without Kineto its device times; under the transfer, for use_cuda too)."""
    process_state.core()._card_time_enable(_Placement(profile), profile.name, process_state.config().transfer)
