"""The planned steps as a Chrome trace (the JSON Perfetto and chrome://tracing open): `--trace OUT.json`.

One process per played rank; in it one track per stream of the card, with its kernels and
synchronous collectives, and one per communicator that ran asynchronous collectives on its own
stream, as complete events ("X", microseconds), the step ends as instant events on a track
of their own, and the card's allocated bytes as a counter track.
"""

import json
from typing import Dict, List

from supa_emu.plan.stream_keys import is_communicator_stream

STEPS_TRACK = 0  # the tracks of streams follow


def events(rank: int, launches: list, memory: list) -> list:
    """Trace events of one rank from the schedule's (stream key, name, start, end, category,
    flops, bytes) launches and (time, allocated bytes) points."""
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} (planned card)"}},
           {"ph": "M", "name": "thread_name", "pid": rank, "tid": STEPS_TRACK, "args": {"name": "steps"}}]
    tracks: Dict[tuple, int] = {}
    for key, name, start, end, category, flops, nbytes in launches:
        if key is None:
            out.append({"ph": "i", "s": "t", "name": name, "pid": rank, "tid": STEPS_TRACK, "ts": start * 1e6})
            continue
        if key not in tracks:
            tracks[key] = len(tracks) + 1
            device, stream = key
            if is_communicator_stream(stream):
                label = f"supa:{device} {stream} (communicator)"
            else:
                label = f"supa:{device} stream {stream}" + (" (default)" if stream == 0 else "")
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tracks[key], "args": {"name": label}})
        out.append({"ph": "X", "name": name, "cat": category, "pid": rank, "tid": tracks[key], "ts": start * 1e6,
                    "dur": (end - start) * 1e6, "args": {"flops": flops, "bytes": nbytes}})
    last = None
    for when, allocated in memory:
        if allocated != last:
            out.append({"ph": "C", "name": "card memory", "pid": rank, "ts": when * 1e6,
                        "args": {"allocated bytes": allocated}})
            last = allocated
    return out


def write(path: str, per_rank: List[list]) -> None:
    with open(path, "w") as out:
        json.dump({"traceEvents": [e for rank_events in per_rank for e in rank_events],
                   "displayTimeUnit": "ms"}, out)
