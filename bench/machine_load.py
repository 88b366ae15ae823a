"""The machine's load average, printed by every benchmark at start and end so a reader can judge its ratios."""

import os


def load() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg())
