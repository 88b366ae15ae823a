"""Run memory_probe.py with the caching allocator's history on; write what was live at each phase's
peak and end, grouped by the Python stack that allocated it.

    python trace_probe.py OUT.json.gz -- MEMORY_PROBE_ARGS...

On a card (`--fake-world N ...`) and on emulated cards (as the planner's rank 0:
`python -m supa_emu.plan --world-size N --rank 0 -- trace_probe.py OUT.json.gz -- ARGS...`), so
the two files can be compared allocation by allocation where their figures differ. The phases are
those memory_probe.py reports: `initialize()`, then each step; a phase ends where the probe resets
the peak statistics. Each live block is listed once per (size, stack) with a count.
"""

import collections
import gzip
import json
import os
import runpy
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FRAMES_KEPT = 12


def short_frame(frame: dict) -> str:
    path = frame["filename"]
    for anchor in ("site-packages/", "dist-packages/", "/supa_emu/"):
        if anchor in path:
            path = path.split(anchor, 1)[1]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{frame['line']}:{frame['name']}"


def stack_of(event: dict) -> tuple:
    frames = [short_frame(f) for f in event.get("frames", []) if "filename" in f]
    # Drop this wrapper and runpy, which only the traced run has.
    frames = [f for f in frames if not f.startswith(("trace_probe.py", "runpy.py", "<frozen runpy>"))]
    return tuple(frames[:FRAMES_KEPT])


def grouped(live: dict) -> list:
    counts = collections.Counter(live.values())
    return sorted(([count, size, list(stack)] for (size, stack), count in counts.items()),
                  key=lambda row: -row[0] * row[1])


def replay(live: dict, events: list) -> int:
    """Apply allocations and frees to `live` (address -> (size, stack)); the change in bytes."""
    change = 0
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], stack_of(event))
            change += event["size"]
        elif event["action"] == "free_completed":
            change -= live.pop(event["addr"])[0]
    return change


def phases(trace: list, ends: list) -> list:
    """Per phase: the peak allocated, and the blocks live at the peak and at the end."""
    live, allocated, start, out = {}, 0, 0, []
    for end in ends:
        peak, peak_at, running = allocated, start, allocated
        for at in range(start, end):
            event = trace[at]
            if event["action"] == "alloc":
                running += event["size"]
            elif event["action"] == "free_completed":
                running -= event["size"]
            if running > peak:
                peak, peak_at = running, at + 1
        at_peak = dict(live)
        replay(at_peak, trace[start:peak_at])
        allocated += replay(live, trace[start:end])
        start = end
        out.append({"peak": peak, "end": allocated, "peak_live": grouped(at_peak), "end_live": grouped(live)})
    return out


def main() -> None:
    out_path, separator, probe_args = sys.argv[1], sys.argv[2], sys.argv[3:]
    if separator != "--":
        raise SystemExit("usage: trace_probe.py OUT.json.gz -- MEMORY_PROBE_ARGS...")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    memory = getattr(torch, accelerator.device_name()).memory
    memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=50_000_000)
    device = torch.device(accelerator.device_name(int(os.environ.get("LOCAL_RANK", 0))))

    def trace() -> list:
        return memory._snapshot()["device_traces"][device.index or 0]

    ends = []
    reset = accelerator.reset_peak_memory_stats

    def reset_and_mark(*args, **kwargs):
        ends.append(len(trace()))
        return reset(*args, **kwargs)

    accelerator.reset_peak_memory_stats = reset_and_mark
    sys.argv = [os.path.join(HERE, "memory_probe.py"), *probe_args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    events = trace()
    result = {"args": " ".join(probe_args), "device": str(device), "torch": torch.__version__,
              "events": len(events), "phases": phases(events, ends)}
    with gzip.open(out_path, "wt") as f:
        json.dump(result, f)
    print("TRACED " + json.dumps({"phases": [(p["peak"], p["end"]) for p in result["phases"]]}), flush=True)


if __name__ == "__main__":
    main()
