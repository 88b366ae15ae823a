"""The card's time for a planned rank: the operator stream played on the profile's card, stream by stream.

The host issues launches one after the other, each costing it `host_op_s` (eager PyTorch's
dispatch on a server CPU). A launch runs on its stream after the stream's previous work and after
the events the stream was told to wait for, no earlier than the host issued it; it takes the
card's launch latency plus the longer of its arithmetic time (FLOPs over the dtype's peak times
the family's efficiency at that size, efficiency.py) and its memory time (bytes over the memory
bandwidth times the memory curve). Copies between host and card take the host link; a copy to the
host (and `.item()`) makes the host wait for it, as do stream, event and device synchronisations.
An event completes when the work its stream had when it was recorded does. So overlap is what the
program's own streams and events allow.

Collectives run as c10d's NCCL process group of recent PyTorch runs them (bccl the same): those of
one communicator (a process group's, on one card; point-to-point: one per pair of peers) one
after another, NCCL ordering each launch after the communicator's previous one whatever stream it
is issued on. A synchronous call (async_op=False) runs on the issuing stream itself. An
asynchronous one runs on the communicator's own stream, after the work the issuing stream had
when it was issued; the issuing stream goes on, and a stream waits for it only where the program
waits for its work (`wait()`: the stream current then; a barrier's wait holds the host too). Each
takes the time collective_time.py gives. Exposed communication is only what a stream or the host
was held up by: a synchronous collective, and a wait that found its collective still running; an
asynchronous collective nobody waits for runs beside the rest.

A step ends at each step mark (op_stream.py); its time is from the previous step's end (the
moment all work issued before it completes) to its own. The split tells, for each moment of the
step, the highest of: a compute-bound kernel running, a memory-bound one, a host-link copy, a
collective (exposed communication), a launch's latency, the host issuing while the card waits
(host-bound), and nothing (idle). Whatever the host is still waiting for on a communicator's
stream at a step's end (or a device synchronisation) is exposed communication too.

A send or receive whose peer the plan plays too waits for the peer's side (p2p_time.py): it
starts no earlier than both sides posted it, and the time a stream or the host waits for the peer
to post is idle, not communication (a later pipeline stage waiting for the earlier one's forward).
"""

import collections
import statistics
from typing import Dict, List, NamedTuple, Optional

from supa_emu import card_profiles
from supa_emu.plan import collective_time, efficiency, op_costs, p2p_time
from supa_emu.plan.stream_keys import communicator_stream, is_communicator_stream

OP, EVENT_RECORD, EVENT_WAIT, STREAM_SYNC, EVENT_SYNC, DEVICE_SYNC, MARK = range(7)
STEP_MARK = -1

# Eager PyTorch's own time per launched operator on a server CPU (Python, dispatcher, autograd's
# bookkeeping): a few microseconds in PyTorch's own overhead measurements; an assumption until a
# card measures it (docs/time_on_the_card.md).
HOST_OP_SECONDS = 5e-6

SPLIT = ("compute", "memory", "host_link", "communication", "launch", "host", "idle")
_PRIORITY = {name: i for i, name in enumerate(SPLIT)}
TOP_OPS = 10
MEMORY_POINTS = 600


class Collective(NamedTuple):
    """A collective as op_stream.py marks it: its cost's inputs and where it runs."""

    op: str
    nbytes: int
    group_size: int
    hosts: int
    communicator: str = "default"  # the collectives of one communicator run one after another
    asynchronous: bool = False  # async_op=True: on the communicator's stream, waited for only by wait()
    transfer: Optional[p2p_time.Transfer] = None  # a send or recv to a known peer: its channel and number


class Waited(NamedTuple):
    """The program waited for the work of the collective marked `collective` (its index)."""

    collective: int
    host: bool = False  # a barrier: the host waits for it too


def launch_seconds(p: card_profiles.CardProfile, c: op_costs.OpCost) -> tuple:
    """(arithmetic seconds, memory seconds) of a launch of cost `c` on `p`'s card (launch latency apart);
    the profiler's card track (supa_emu/card_time.py) times a running program's launches with it too."""
    if c.kind in ("h2d", "d2h"):
        return 0.0, c.bytes / (p.host_link_bandwidth * efficiency.HOST_LINK_EFFICIENCY)
    arithmetic = c.flops / (p.peak_flops[c.family] * efficiency.fraction(c.kind, c.flops)) if c.flops else 0.0
    memory = c.bytes / (p.memory_bandwidth * efficiency.fraction("memory", c.bytes)) if c.bytes else 0.0
    return arithmetic, memory


class Schedule:
    """Plays launches on the card's streams and keeps each step's figures."""

    def __init__(self, profile: card_profiles.CardProfile, nic_gbps: float = 400.0,
                 host_op_s: float = HOST_OP_SECONDS, rank: int = 0, keep_trace: bool = False,
                 peers: Optional[p2p_time.PeerPosts] = None):
        self.profile, self.nic_gbps, self.host_op_s, self.rank = profile, nic_gbps, host_op_s, rank
        self.tokens_per_step = None
        self.host = 0.0
        self.ready: Dict[tuple, float] = {}  # (device, stream) -> when its queued work completes
        self.events: Dict[int, float] = {}
        self.step_start = 0.0
        self.steps: List[dict] = []
        self._intervals: list = []  # (start, end, split category) of the current step
        self._ops = collections.defaultdict(lambda: [0.0, 0, 0.0])  # name -> [seconds, launches, FLOPs]
        self._step_flops = collections.defaultdict(float)  # dtype family -> FLOPs this step
        self._launches = 0
        self._keep_trace = keep_trace
        self._trace: list = []
        self._memory: list = []
        self._cost_cache: dict = {}
        self.untimed: Dict[str, int] = {}  # collectives without a time model: op -> calls
        self._communicator_free: Dict[str, float] = {}  # communicator -> when its last collective ends
        self._collective_ends: Dict[int, object] = {}  # collective mark -> when it ends (or its p2p_time.Pending)
        self._busy_from: Dict[tuple, float] = {}  # communicator stream -> when its last transfer started
        self.transfers = p2p_time.Transfers(peers, self._transfer_resolved)

    @classmethod
    def from_settings(cls, settings: dict, peers: Optional[p2p_time.PeerPosts] = None) -> "Schedule":
        return cls(card_profiles.from_fields(settings["card"], "card profile"), settings["nic_gbps"],
                   settings["host_op_s"], settings["rank"], settings.get("trace", False), peers)

    # ---- playing the stream ------------------------------------------------------------------
    def feed(self, entries, names: List[str], collectives: list) -> None:
        for kind, name, device, stream, aux, ins, outs in entries:
            key = (device, stream)
            if kind == OP:
                self._launch(names[name], key, ins, outs, aux)
            elif kind == EVENT_RECORD:
                self.events[aux] = self.ready.get(key, 0.0)
            elif kind == EVENT_WAIT:
                self.ready[key] = max(self.ready.get(key, 0.0), self.events.get(aux, 0.0))
            elif kind == STREAM_SYNC:
                self.host = max(self.host, self.ready.get(key, 0.0))
            elif kind == EVENT_SYNC:
                self.host = max(self.host, self.events.get(aux, 0.0))
            elif kind == DEVICE_SYNC:
                self.host = self._all_done(device)
            elif kind == MARK and aux == STEP_MARK:
                self._end_step()
            elif kind == MARK and isinstance(collectives[aux], Waited):
                self._waited(collectives[aux], key)
            elif kind == MARK:
                self._collective(aux, collectives[aux], key)

    def _cost(self, name: str, ins, outs) -> op_costs.OpCost:
        signature = (name, repr(ins), repr(outs))
        found = self._cost_cache.get(signature)
        if found is None:
            found = self._cost_cache[signature] = op_costs.cost(name, ins, outs)
        return found

    def seconds(self, c: op_costs.OpCost) -> tuple:
        return launch_seconds(self.profile, c)

    def _issue(self) -> float:
        self.host += self.host_op_s
        self._intervals.append((self.host - self.host_op_s, self.host, "host"))
        return self.host

    def _launch(self, name: str, key: tuple, ins, outs, allocated: int) -> None:
        c = self._cost(name, ins, outs)
        if c.kind == "none":
            return
        start = max(self._issue(), self.ready.get(key, 0.0))
        arithmetic, memory = self.seconds(c)
        busy = max(arithmetic, memory)
        if c.kind in ("h2d", "d2h"):
            category = "host_link"
        else:
            category = "compute" if arithmetic >= memory and c.flops else "memory"
        latency = self.profile.launch_latency
        end = start + latency + busy
        self.ready[key] = end
        self._intervals.append((start, start + latency, "launch"))
        self._intervals.append((start + latency, end, category))
        if c.host_waits:
            self.host = max(self.host, end)
        totals = self._ops[name]
        totals[0] += latency + busy
        totals[1] += 1
        totals[2] += c.flops
        self._step_flops[c.family] += c.flops
        self._launches += 1
        if not self._memory or self._memory[-1][1] != allocated:
            self._memory.append((end, allocated))
        if self._keep_trace:
            self._trace.append((key, name, start, end, category, c.flops, c.bytes))

    def _collective(self, mark: int, c: Collective, key: tuple) -> None:
        issued = max(self._issue(), self.ready.get(key, 0.0))  # the issuing stream's work so far is done
        if c.op in ("send", "recv") and self.transfers.matched(c.transfer):
            self._transfer(mark, c, key, issued)
            return
        start = max(issued, self._communicator_free.get(c.communicator, 0.0))
        try:
            end = start + collective_time.seconds(c.op, c.nbytes, c.group_size, c.hosts, self.profile, self.nic_gbps)
        except ValueError:  # a collective the model has no cost for: named in the report, not guessed
            self.untimed[c.op] = self.untimed.get(c.op, 0) + 1
            end = start
        self._communicator_free[c.communicator] = self._collective_ends[mark] = end
        runs_on = (key[0], communicator_stream(c.communicator)) if c.asynchronous else key
        self.ready[runs_on] = end
        self._busy_from.pop(runs_on, None)
        if not c.asynchronous:  # the issuing stream is held from its own work's end to the collective's
            self._intervals.append((issued, end, "communication"))
        name = f"bccl:{c.op}"
        totals = self._ops[name]
        totals[0] += end - start
        totals[1] += 1
        if self._keep_trace:
            self._trace.append((runs_on, name, start, end, "communication", 0.0, c.nbytes))

    def _transfer(self, mark: int, c: Collective, key: tuple, issued: float) -> None:
        """A send or receive with a played peer: its end is resolved where needed (p2p_time.Transfers)."""
        seconds = collective_time.seconds(c.op, c.nbytes, c.group_size, c.hosts, self.profile, self.nic_gbps)
        runs_on = (key[0], communicator_stream(c.communicator)) if c.asynchronous else key
        pending = self.transfers.issue(c.transfer, issued, seconds, runs_on, f"bccl:{c.op}", c.nbytes)
        self._collective_ends[mark] = pending
        totals = self._ops[pending.name]
        totals[0] += seconds
        totals[1] += 1
        if not c.asynchronous:  # the issuing stream is held until it ends; the wait for the peer is idle
            end = self.transfers.end(pending)
            self._intervals.append((max(issued, pending.start), end, "communication"))

    def _transfer_resolved(self, pending: p2p_time.Pending) -> None:
        self.ready[pending.runs_on] = max(self.ready.get(pending.runs_on, 0.0), pending.end)
        self._busy_from[pending.runs_on] = pending.start
        if self._keep_trace:
            self._trace.append((pending.runs_on, pending.name, pending.start, pending.end, "communication", 0.0,
                                pending.nbytes))

    def _waited(self, waited: Waited, key: tuple) -> None:
        """The current stream (and for a barrier the host) waits for a collective's end."""
        end = self._collective_ends.get(waited.collective)
        if end is None:  # issued before the recording began
            return
        held_from = max(self.ready.get(key, 0.0), self.host)
        if isinstance(end, p2p_time.Pending):  # until the transfer starts, the stream waits for the peer: idle
            pending = end
            end = self.transfers.end(pending)
            held_from = max(held_from, pending.start)
        if end > held_from:
            self._intervals.append((held_from, end, "communication"))
        self.ready[key] = max(self.ready.get(key, 0.0), end)
        if waited.host and end > self.host:
            self._intervals.append((self.host, end, "communication"))
            self.host = end

    def _all_done(self, device=None) -> float:
        """When the host, waiting for all streams (of `device`, or of every card), is through: where
        a communicator's stream is the last, the wait for it is exposed communication (a transfer's wait
        for its peer to post is idle)."""
        self.transfers.resolve_all()
        mine = [((d, stream), t) for (d, stream), t in self.ready.items() if device is None or d == device]
        own = max([self.host] + [t for (d, stream), t in mine if not is_communicator_stream(stream)])
        communication = [(key, t) for key, t in mine if is_communicator_stream(key[1]) and t > own]
        for key, t in communication:
            self._intervals.append((max(own, self._busy_from.get(key, own)), t, "communication"))
        return max([own] + [t for key, t in communication])

    # ---- steps -------------------------------------------------------------------------------
    def _end_step(self) -> None:
        end = self._all_done()
        begin = self.step_start
        split = self._split(begin, end)
        flops = sum(self._step_flops.values())
        family = max(self._step_flops, key=self._step_flops.get) if flops else "bf16"
        seconds = end - begin
        step = {"step": len(self.steps) + 1, "start_s": begin, "seconds": seconds, "flops": flops,
                "mfu": flops / (seconds * self.profile.peak_flops[family]) if seconds > 0 else 0.0,
                "peak_family": family, "split": split, "tokens": self.tokens_per_step}
        self.steps.append(step)
        if self._keep_trace:
            self._trace.append((None, f"step {step['step']}", end, end, "step", 0.0, 0.0))
        self.step_start = end
        self._intervals = [i for i in self._intervals if i[1] > end]
        self._step_flops.clear()

    def _split(self, begin: float, end: float) -> dict:
        """Seconds of [begin, end] by the highest category active at each moment (SPLIT's order)."""
        points = []
        for start, stop, category in self._intervals:
            start, stop = max(start, begin), min(stop, end)
            if stop > start:
                points.append((start, 1, _PRIORITY[category]))
                points.append((stop, -1, _PRIORITY[category]))
        points.sort()
        active = [0] * len(SPLIT)
        split = dict.fromkeys(SPLIT, 0.0)
        at = begin
        for when, change, priority in points:
            if when > at:
                top = next((i for i, n in enumerate(active) if n), _PRIORITY["idle"])
                split[SPLIT[top]] += when - at
                at = when
            active[priority] += change
        split["idle"] += max(0.0, end - at)
        return split

    # ---- reports -----------------------------------------------------------------------------
    def report(self) -> dict:
        """{card, nic_gbps, host_op_us, launches, steps, step_seconds (median after the first),
        tokens_per_s, mfu, top_ops, untimed_collectives, memory: [[planned seconds, allocated bytes]],
        at most MEMORY_POINTS keeping each stretch's highest}."""
        steady = self.steps[1:] or self.steps
        step_seconds = statistics.median(s["seconds"] for s in steady) if steady else None
        tokens = steady[-1]["tokens"] if steady else None
        mfu = statistics.median(s["mfu"] for s in steady) if steady else None
        ranked = sorted(self._ops.items(), key=lambda item: -item[1][0])[:TOP_OPS]
        return {"card": self.profile.name, "nic_gbps": self.nic_gbps, "host_op_us": self.host_op_s * 1e6,
                "launches": self._launches, "steps": self.steps, "step_seconds": step_seconds,
                "tokens_per_step": tokens,
                "tokens_per_s": tokens / step_seconds if tokens and step_seconds else None, "mfu": mfu,
                "top_ops": [{"op": name, "seconds": t, "count": n, "flops": f} for name, (t, n, f) in ranked],
                "untimed_collectives": [{"op": op, "count": n} for op, n in self.untimed.items()],
                "point_to_point": self.transfers.report(),
                "memory": self._memory_points()}

    def _memory_points(self) -> list:
        stretch = -(-len(self._memory) // MEMORY_POINTS) or 1
        return [list(max(self._memory[i:i + stretch], key=lambda p: p[1]))
                for i in range(0, len(self._memory), stretch)]

    def trace_events(self) -> list:
        """Chrome trace events (microseconds): a track per stream, step marks, a memory counter."""
        from supa_emu.plan import trace

        return trace.events(self.rank, self._trace, self._memory)
