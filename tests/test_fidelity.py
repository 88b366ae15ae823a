"""The emulated card's memory held to a real GPU's: each configuration of tests/data/fidelity/h200_reference.jsonl
runs as the planner's rank 0 of N, and its peaks and steady state must be within the bar of the card's.

A plan may read a little high, never low: step peak and what stays allocated at the end of each step
within [1.00, 1.05] of the card's, the initialize() peak within [0.99, 1.05]. Each line of the reference
is one test, so a configuration added there is held to the same bar.

Every configuration runs in the planner's shapes mode (no FLOPs: 10-20 s each on 2 cores), the mode
that plans the large jobs; compute mode (every kernel runs: up to 3 minutes a configuration) runs the
cheapest one, GPT 355M ZeRO-2 N=8, and tests/test_plan.py and tests/test_shapes.py hold the two modes
to each other to the byte. The fast tier runs that configuration in shapes mode.
"""

import json
import pathlib
import shlex
import sys

import pytest

from harness import fresh_process

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
pytestmark = pytest.mark.emulation_only

DATA = pathlib.Path(__file__).resolve().parent / "data" / "fidelity"
PROBE = DATA / "memory_probe.py"
REFERENCE = [json.loads(line) for line in (DATA / "h200_reference.jsonl").read_text().splitlines() if line.strip()]
FAST = "--fake-world 8 --stage 2"
STEP_BAR = (1.00, 1.05)
INIT_BAR = (0.99, 1.05)


def planner_arguments(card_args: str) -> tuple[int, list[str]]:
    """(N, the probe's other arguments) from the card's `--fake-world N ...`."""
    args = shlex.split(card_args)
    at = args.index("--fake-world")
    world = int(args[at + 1])
    return world, args[:at] + args[at + 2:]


def plan(card_args: str, mode: str) -> dict:
    """The probe's RESULT as the planner's rank 0 of N, in the planner's `mode`."""
    world, args = planner_arguments(card_args)
    finished = fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", str(world), "--rank", "0",
                              "--mode", mode, "--", str(PROBE), *args], timeout=1800)
    [result] = finished.json_lines("RESULT ")
    return result


def ratios(card: dict, emulated: dict) -> dict:
    """Emulated / card, per figure: init_peak, and peak and end of each step."""
    out = {"init_peak": emulated["init_peak"] / card["init_peak"]}
    for i, (c, e) in enumerate(zip(card["steps"], emulated["steps"], strict=True)):
        out[f"step {i + 1} peak"] = e["peak"] / c["peak"]
        out[f"step {i + 1} end"] = e["end"] / c["end"]
    return out


def within_bar(name: str, ratio: float) -> bool:
    low, high = INIT_BAR if name == "init_peak" else STEP_BAR
    return low <= ratio <= high


def row(card: dict, emulated: dict) -> str:
    """The configuration's line of docs/operator_memory.md's table (MiB; highest step peak, last step's end)."""
    mib = 2 ** 20
    card_peak, emulated_peak = max(s["peak"] for s in card["steps"]), max(s["peak"] for s in emulated["steps"])
    card_end, emulated_end = card["steps"][-1]["end"], emulated["steps"][-1]["end"]
    return (f"| `{card['args']}` | {card_peak / mib:.0f} | {emulated_peak / mib:.0f} | {emulated_peak / card_peak:.3f} "
            f"| {card_end / mib:.0f} | {emulated_end / mib:.0f} | {emulated_end / card_end:.3f} "
            f"| {emulated['init_peak'] / card['init_peak']:.3f} |")


def _runs():
    for line in REFERENCE:
        yield pytest.param(line, "shapes", id=f"shapes: {line['args']}",
                           marks=[] if line["args"] == FAST else [pytest.mark.slow])
    yield from (pytest.param(line, "compute", id=f"compute: {line['args']}", marks=[pytest.mark.slow])
                for line in REFERENCE if line["args"] == FAST)


@pytest.mark.parametrize("card, mode", _runs())
def test_planned_memory_is_within_the_bar_of_the_card_s(card, mode):
    emulated = plan(card["args"], mode)
    print("\n" + row(card, emulated))
    measured = ratios(card, emulated)
    outside = {name: round(value, 4) for name, value in measured.items() if not within_bar(name, value)}
    assert not outside, f"emulated / card outside the bar: {outside}; all: " \
                        f"{ {name: round(value, 4) for name, value in measured.items()} }"


def test_the_planner_s_arguments_are_the_card_s_without_the_fake_world():
    assert planner_arguments("--fake-world 16 --engine fsdp2 --seq 512 --ckpt") == \
        (16, ["--engine", "fsdp2", "--seq", "512", "--ckpt"])
    assert any(line["args"] == FAST for line in REFERENCE)
