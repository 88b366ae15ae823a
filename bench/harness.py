"""What the benchmarks here share: the load average they print at start and end, and the device check."""

import os


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())


def require_supa() -> None:
    """Exit with a clear message unless a supa device exists (emulated or real)."""
    import torch  # not at import: deepspeed_step.py's driver never imports torch itself

    if not (hasattr(torch, "supa") and torch.supa.is_available()):
        raise SystemExit("no supa device: run with SUPA_EMULATE=1")
