"""One rank's record for the planner: its card's memory over time, the peak's phase, its collectives.

The memory figures come from the card's own allocation history (torch.supa.memory's
`_record_memory_history`, the one a real run records): the running sum of its alloc and free
events is the allocated-bytes statistic, event by event, so the peak found here is the
allocator's peak even when the script resets the peak statistics. Recording starts with the
first bccl group (or, in the planner's rank process, before the script runs); memory allocated
before that is the baseline. A real run records the same way under SUPA_PLAN_RECORD=DIR, which
writes DIR/rank-R.json at exit.

A script marks the parts it wants figures for with `with supa_emu.plan.section(name):` (a
training phase, an evaluation, one of several configurations run in turn); the record then lists
each section's peak allocated and reserved bytes and its collectives. Like an NVTX range, a
section only marks: in a run that records nothing it has no effect.
"""

import atexit
import contextlib
import json
import os
import pathlib
import time
from typing import Optional

import torch

from supa_emu import distributed, shapes
from supa_emu.device_type import DEVICE_TYPE
from supa_emu.plan import call_record

TIMELINE_POINTS = 600

_state: Optional[dict] = None
# Sections entered so far: {name, start, end}, where start/end are (event count per device,
# collectives so far); a start of None is the beginning of recording.
_sections: list = []


class _Recording(distributed.Watcher):
    """Starts the record at the first bccl group (unless it started before) and counts every
    collective on the card (a planned rank's gloo groups issue theirs on host tensors: as a real
    gloo group's, they are not the card's)."""

    def __init__(self, directory: Optional[pathlib.Path]):
        self._directory = directory

    def group_created(self, rank: int) -> None:
        _begin(self._directory, rank)

    def collective_issued(self, group, call, work) -> None:
        if group.kind.device_type == DEVICE_TYPE:
            call_record.note_call(group.size(), call)


def start(directory: Optional[pathlib.Path], rank: Optional[int] = None) -> None:
    """Records this process's card memory and bccl collectives: from now on, as `rank` (the
    planner's rank process), or without a rank from the first bccl group on, as its rank (a real
    run under SUPA_PLAN_RECORD). With a directory, the record is written there at exit."""
    distributed.watch(_Recording(directory))
    if rank is not None:
        _begin(directory, rank)


def _begin(directory: Optional[pathlib.Path], rank: int) -> None:
    global _state
    if _state is not None:
        return
    devices = range(torch.supa.device_count())
    _state = {
        "directory": directory, "rank": rank, "started": time.time(),
        "baseline": {d: (torch.supa.memory_allocated(d), torch.supa.memory_reserved(d),
                         torch.supa.max_memory_allocated(d), torch.supa.max_memory_reserved(d)) for d in devices},
    }
    torch.supa.memory._record_memory_history("all", context="alloc", stacks="python")
    if directory is not None:
        atexit.register(_write_at_exit)


def name_user_code(directories) -> None:
    """Peak locations name the innermost frame under these directories (the script's, or the
    package of a module run with -m) rather than the first frame outside PyTorch and DeepSpeed."""
    _state["user_code"] = [os.path.join(os.path.abspath(d), "") for d in directories]


def _position():
    if _state is None:
        return None
    counts = [len(trace) for trace in torch.supa.memory._snapshot()["device_traces"]]
    return counts, call_record.counts()


@contextlib.contextmanager
def section(name: str):
    """Marks a part of the script: the record gives its peak memory and collectives apart."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"section name must be a non-empty str, got {name!r}")
    entry = {"name": name, "start": _position(), "end": None}
    _sections.append(entry)
    try:
        yield
    finally:
        entry["end"] = _position()


def _write_at_exit() -> None:
    path = pathlib.Path(_state["directory"])
    path.mkdir(parents=True, exist_ok=True)
    (path / f"rank-{_state['rank']}.json").write_text(json.dumps(record()))


# Frames that tell which part of a training step an allocation belongs to: (file part, function, phase).
_PHASES = (
    ("deepspeed/__init__.py", "initialize", "initialize"),
    ("deepspeed/runtime/engine.py", "forward", "forward"),
    ("deepspeed/runtime/engine.py", "backward", "backward"),
    ("deepspeed/runtime/engine.py", "step", "step"),
    ("deepspeed/runtime/zero/", "step", "optimizer"),
    ("deepspeed/runtime/bf16_optimizer.py", "step", "optimizer"),
    ("deepspeed/runtime/fp16/", "step", "optimizer"),
    ("torch/optim/", "step", "optimizer"),
    ("torch/autograd/", "backward", "backward"),
    ("torch/nn/modules/module.py", "_call_impl", "forward"),
)


def _phase(frames) -> tuple:
    """(phase, innermost frame of the script) of a Python stack (innermost frame first)."""
    phase = None
    for frame in reversed(frames):  # outermost first: the innermost match is the most specific
        filename = frame["filename"].replace(os.sep, "/")
        for part, function, name in _PHASES:
            if part in filename and frame["name"] == function and not (phase == "optimizer" and name == "step"):
                phase = name
    if phase is None and frames and not any(f["name"] == "<module>" for f in frames):
        phase = "backward"  # a stack that does not start in the script ran on autograd's device thread
    return phase or "unknown", _location(frames)


def _described(frame) -> str:
    return f"{frame['filename']}:{frame['line']} ({frame['name']})"


def _location(frames):
    """The innermost frame of the user's code: under the directories name_user_code gave, else the
    first outside installed packages, the emulator and Python's own frozen modules (runpy)."""
    user_code = (_state or {}).get("user_code", [])
    for frame in frames:
        path = os.path.abspath(frame["filename"])
        if "/supa_emu/" not in path and any(path.startswith(d) for d in user_code):
            return _described(frame)
    return next((_described(f) for f in frames if "site-packages" not in f["filename"]
                 and "/supa_emu/" not in f["filename"] and not f["filename"].startswith("<")), None)


def _device_events(snapshot) -> tuple:
    """(device index, its trace) of the card this rank used: the one with the most traffic."""
    traces = snapshot["device_traces"]
    if not traces:
        return torch.supa.current_device(), []
    device = max(range(len(traces)), key=lambda d: (len(traces[d]), d == torch.supa.current_device()))
    return device, traces[device]


def record(failure: Optional[dict] = None) -> dict:
    """This rank's record so far (see the planner's report for the keys)."""
    snapshot = torch.supa.memory._snapshot()
    device, events = _device_events(snapshot)
    allocated, reserved, base_peak, base_peak_reserved = _state["baseline"].get(device, (0, 0, 0, 0))
    peak, peak_reserved, peak_event = max(allocated, base_peak), max(reserved, base_peak_reserved), None
    t0 = _state["started"] * 1e6
    points, ooms, running = [], [], [(allocated, reserved)]
    for index, event in enumerate(events):
        # "size" is what was asked for, as on a card; the card's figures count whole blocks.
        action, size = event["action"], event["block_size"]
        if action == "alloc":
            allocated += size
        elif action == "free_completed":
            allocated -= size
        elif action in ("segment_alloc", "segment_map"):  # (pages of an expandable segment: map, unmap)
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "oom":
            oom_phase, oom_location = _phase(event["frames"])
            ooms.append({"requested_bytes": event["size"], "allocated": allocated, "reserved": reserved,
                         "time_s": (event["time_us"] - t0) / 1e6, "phase": oom_phase, "location": oom_location})
        if allocated > peak:
            peak, peak_event = allocated, event
        peak_reserved = max(peak_reserved, reserved)
        running.append((allocated, reserved))
        points.append((index, (event["time_us"] - t0) / 1e6, allocated, reserved))
    phase, location = _phase(peak_event["frames"]) if peak_event is not None else ("before recording", None)
    capacity = torch.supa.mem_get_info(device)[1]
    return {
        "rank": _state["rank"], "device": device, "capacity": capacity,
        "peak_allocated": peak, "peak_reserved": peak_reserved,
        "peak_phase": phase, "peak_location": location,
        "oom": bool(ooms) or peak_reserved > capacity, "oom_events": ooms,
        "timeline": _thin(points, TIMELINE_POINTS),
        "collectives": call_record.collectives(),
        "mode": shapes.mode(),
        "value_dependent": call_record.value_dependent() + _kernels_run(shapes.VALUE_DEPENDENT),
        "no_shape_rule": _kernels_run(shapes.NO_SHAPE_RULE),
        "sections": [_section_figures(entry, device, running) for entry in _sections if entry["end"] is not None],
        "failure": failure,
    }


# What a value-dependent call of shapes mode did, by the kind of operator (shapes.py).
_VALUE_DEPENDENT_EXPLAINED = {
    "read": "read values the plan did not compute (a skipped kernel's result reads as zeros)",
    "check": "checks values the plan did not compute; not checked",
    "shape": "its output's shape depends on values the plan did not compute; ran on the values the card held",
}


def _kernels_run(kind: str) -> list:
    """Shapes mode's operators of `kind` that ran their kernels (or skipped a check): [{what, count, site}]."""
    def explained(op: str) -> str:
        if kind == shapes.NO_SHAPE_RULE:
            return "PyTorch has no shape rule for it; its kernel ran"
        return _VALUE_DEPENDENT_EXPLAINED[shapes.value_dependent_kind(op)]

    return [{"what": f"{note['op']}: {explained(note['op'])}", "count": note["count"], "site": site(note["frames"])}
            for note in shapes.notes() if note["kind"] == kind]


def site(frames) -> str:
    """The user's line that led to a call, and the innermost Python frame where that is elsewhere."""
    where = _location(frames)
    innermost = _described(frames[0]) if frames else None
    return where if innermost in (None, where) else f"{where}, in {innermost}"


def _section_figures(entry: dict, device: int, running: list) -> dict:
    """A section's peaks over the events it spans (from the figures on entry) and the collectives it made.

    `running[i]` is (allocated, reserved) after the first i events of the device's trace."""
    start_events, start_calls = entry["start"] or ([], {})
    end_events, end_calls = entry["end"]
    first = start_events[device] if device < len(start_events) else 0
    last = end_events[device] if device < len(end_events) else 0
    span = running[first:last + 1]
    made = {kind: count - start_calls.get(kind, 0) for kind, count in end_calls.items()}
    return {"name": entry["name"], "peak_allocated": max(a for a, _ in span),
            "peak_reserved": max(r for _, r in span),
            "collectives": call_record.collectives({kind: count for kind, count in made.items() if count})}


def _thin(points, limit: int) -> list:
    """At most `limit` points, keeping the highest allocation of each stretch (the peak survives)."""
    if len(points) <= limit:
        return [list(p) for p in points]
    stretch = -(-len(points) // limit)
    return [list(max(points[i:i + stretch], key=lambda p: p[2])) for i in range(0, len(points), stretch)]
