"""Point-to-point transfers timed with both their ends: the pipeline's bubble in the planned step time.

A send and its receive are one transfer. Where the plan plays both ranks, each side publishes when
it posted its side (its issuing stream's earlier work done) and the transfer starts at the later
of the two posts, after the previous transfer of its channel, as NCCL's rendezvous does: a stage
idles until the stage before it sends. docs/time_on_the_card.md, "The model" (point-to-point
between played ranks), gives the rules; in short:

- transfers are numbered per channel (group, sending global rank, receiving global rank) in
  program order on each side, as NCCL matches a pair's calls in order (op_stream.py numbers them);
- each rank appends its posts to its own log in the plan's directory (`time/posts-R`, a JSON line
  each: group, source, destination, number, side, seconds) as it plays its schedule at a step's
  end, and resolves a transfer's end only where it is needed (Transfers.end), waiting for the
  peer's post there (PlanDirectory.wait: `waiting-R` says for which post);
- the model blocks a rank's whole play where a card blocks one stream, so where the ranks waiting
  for each other (for posts, or for messages: p2p_messages.py) form a cycle that stays (the plan
  directory's records of who waits for what), the lowest rank of the cycle that waits for a post
  times its transfer from its own side alone (as does a rank whose peer ended without posting),
  and the report counts it.
"""

import json
import os
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from supa_emu.plan.plan_directory import PlanDirectory, Unchanged, Wait

PEER_NOT_PLAYED, ANY_SOURCE, CYCLE, PEER_ENDED = ("peer not played", "receive from any source",
                                                  "waits crossed", "peer ended without posting")


class Transfer(NamedTuple):
    """One side of a point-to-point transfer: its channel, its number on it (from 1), which side."""

    group: str
    source: int  # global ranks
    destination: int
    number: int
    sends: bool  # this rank is the source

    @property
    def peer(self) -> int:
        return self.destination if self.sends else self.source

    def key(self, sends: bool) -> tuple:
        """The name of one side's post in the logs."""
        return (self.group, self.source, self.destination, self.number, "send" if sends else "recv")


class PeerPosts:
    """This rank's posts and its peers', through the plan's directory (see the module)."""

    def __init__(self, path: str, rank: int, played, planner: int, before_waiting: Callable[[], None] = lambda: None):
        """`before_waiting` runs before this rank first waits for a peer, which may start then (world.py's
        save_root_values: the broadcasts made so far, for the peer)."""
        self.directory, self.rank, self.played, self.planner = PlanDirectory(path), rank, played, planner
        self._before_waiting = before_waiting
        self._log = os.open(self.directory.posts(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._read: Dict[int, Tuple[int, bytes]] = {}  # peer -> (bytes read, an unfinished line)
        self._known: Dict[tuple, float] = {}
        self._met = set()

    def plays(self, peer: int) -> bool:
        return self.played is None or peer in self.played

    def publish(self, transfer: Transfer, seconds: float) -> None:
        os.write(self._log, (json.dumps([*transfer.key(transfer.sends), seconds]) + "\n").encode())

    def _look(self, peer: int, key: tuple) -> Optional[float]:
        if key not in self._known:
            offset, rest = self._read.get(peer, (0, b""))
            try:
                with open(self.directory.posts(peer), "rb") as log:
                    log.seek(offset)
                    new = log.read()
            except FileNotFoundError:
                new = b""
            *lines, rest = (rest + new).split(b"\n")  # a line is whole once its newline is there
            for line in lines:
                *name, seconds = json.loads(line)
                self._known[tuple(name)] = seconds
            self._read[peer] = (offset + len(new), rest)
        return self._known.get(key)

    def peer_post(self, transfer: Transfer) -> Tuple[Optional[float], Optional[str]]:
        """(when the peer posted its side of `transfer`, None) once its log says so, waiting for it;
        (None, why) where this rank times it alone (the peer ended without it, or the waits cross)."""
        peer, key = transfer.peer, transfer.key(not transfer.sends)
        crossed = Unchanged()

        def look() -> Optional[Tuple[Optional[float], Optional[str]]]:
            ended = self.directory.ended(peer)  # before the look: a peer that ended has written all it posts
            found = self._look(peer, key)
            if found is not None:
                return found, None
            if ended:
                return None, PEER_ENDED
            cycle = self._cycle()
            if crossed.stays(cycle) and self.rank == min(who for who, wait in cycle if wait.post is not None):
                return None, CYCLE
            return None

        return self.directory.wait(self.rank, Wait(peer, post=key), look, self.planner, lambda: self._meet(peer))

    def _meet(self, peer: int) -> None:
        """Gives `peer`, which may start now, what it needs from this rank (once)."""
        if peer not in self._met:
            self._before_waiting()
            self._met.add(peer)

    def _cycle(self) -> Optional[tuple]:
        """The waits from this rank around to itself ((rank, what it waits for), ...), or None where
        some rank on the way does not wait."""
        rank, path, seen = self.rank, [], set()
        while rank not in seen:
            seen.add(rank)
            wait = self.directory.waits(rank)
            if wait is None:
                return None
            path.append((rank, wait))
            rank = wait.peer
        return tuple(path) if rank == self.rank else None


class Pending:
    """A transfer issued on this rank: its side's post, its time, and its start and end once resolved."""

    __slots__ = ("transfer", "post", "seconds", "previous", "runs_on", "name", "nbytes", "start", "end")

    def __init__(self, transfer, post, seconds, previous, runs_on, name, nbytes):
        self.transfer, self.post, self.seconds, self.previous = transfer, post, seconds, previous
        self.runs_on, self.name, self.nbytes = runs_on, name, nbytes
        self.start = self.end = None


class Transfers:
    """The transfers a schedule issued with a played peer, resolved where their end is needed."""

    def __init__(self, posts: Optional[PeerPosts], resolved: Callable[[Pending], None]):
        self.posts, self._resolved = posts, resolved
        self._last: Dict[tuple, Pending] = {}  # channel -> its latest transfer
        self._unresolved: List[Pending] = []
        self.with_peer = 0
        self.alone: Dict[str, int] = {}

    def count_alone(self, why: str) -> None:
        self.alone[why] = self.alone.get(why, 0) + 1

    def matched(self, transfer: Optional[Transfer]) -> bool:
        """Whether `transfer` is timed with its peer's post; if not, counts why (timed as any collective)."""
        if transfer is not None and self.posts is not None and self.posts.plays(transfer.peer):
            return True
        self.count_alone(ANY_SOURCE if transfer is None else PEER_NOT_PLAYED)
        return False

    def issue(self, transfer: Transfer, post: float, seconds: float, runs_on: tuple, name: str,
              nbytes: int) -> Pending:
        self.posts.publish(transfer, post)
        channel = transfer[:3]
        pending = Pending(transfer, post, seconds, self._last.get(channel), runs_on, name, nbytes)
        self._last[channel] = pending
        self._unresolved.append(pending)
        return pending

    def end(self, pending: Pending) -> float:
        """When `pending` ends: the later of both posts and its channel's previous transfer's end, plus its time."""
        chain = []
        while pending is not None and pending.end is None:
            chain.append(pending)
            pending = pending.previous
        for p in reversed(chain):
            peer, why = self.posts.peer_post(p.transfer)
            if peer is None:
                self.count_alone(why)
            else:
                self.with_peer += 1
            before = p.previous.end if p.previous is not None else 0.0
            p.start = max(p.post, before, 0.0 if peer is None else peer)
            p.end, p.previous = p.start + p.seconds, None
            self._resolved(p)
        return chain[0].end if chain else pending.end

    def resolve_all(self) -> None:
        """Resolves every transfer issued so far (a step's end or a device synchronisation waits for them)."""
        for pending in self._unresolved:
            self.end(pending)
        self._unresolved = []

    def report(self) -> dict:
        return {"timed_with_peer": self.with_peer, "timed_alone": dict(self.alone)}
