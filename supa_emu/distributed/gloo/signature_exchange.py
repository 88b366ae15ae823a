"""Carriers of bccl's cross-rank agreement check, which keeps a mismatch from crashing a rank.

Gloo trusts every rank to pass the same sizes: when a peer sends more bytes than a rank expects,
gloo aborts the process from its I/O thread, and fewer bytes leave garbage or a hang. bccl therefore
has each rank post a short signature of the collective it is about to run (operation, dtype,
element counts, root, reduction) and compares signatures before gloo traffic can reach a rank
that disagrees (signatures.Agreement decides when a rank may start).

Two carriers:
- `SharedMemoryBoard` when all ranks of the group share a host (the emulator's normal case): a
  small /dev/shm ring per group. Posting and reading cost microseconds and need no round trip,
  so a rank can start its collective as soon as the signatures already posted match its own.
  It watches peer process ids so a dead rank fails the wait at once rather than at the timeout.
- `GlooExchange` otherwise: one small all-gather on a separate gloo group (`exchange(words)`),
  so every collective waits for all signatures.
"""

import ctypes
import datetime
import mmap
import os
import socket
import tempfile
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from supa_emu import process_state

from . import handoff

WORDS = 64  # signature payload per rank per collective, in int64 words
RING = 256  # collectives a rank may run ahead of its slowest peer before it waits
_LIVENESS_PERIOD = 0.05  # seconds between checks that waited-for peers still exist


class CollectiveMismatchError(RuntimeError):
    pass


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot_id:
            boot = boot_id.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # A zombie has exited; its parent just has not collected it yet.
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class SharedMemoryBoard:
    """Per-group ring of signature slots in shared memory.

    Layout (int64 words): for each rank, a header [pid, settled, waiters] followed by RING slots of
    [sequence, verdict, payload...]. Rank r posts collective k in slot k % RING (payload, then
    sequence = k), later its verdict 2k+1 if it started the collective in gloo or 2k if it
    refused it, and advances `settled` to k once it has read its peers' slots for k. It reuses a
    slot only once all peers have settled the collective that last used it. `waiters` counts the
    peers asleep on one of the rank's words, so that its stores wake them only when needed.
    """

    launches_early = True  # every rank sees the board at once: a rank may start before all posted

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, label: str):
        self._rank, self._size, self._timeout, self._label = rank, size, timeout, label
        core = process_state.core()
        # The word offsets are the native core's, which reads and writes the same words.
        self._at = core._board_layout()
        self._slot_words = self._at["slot_header"] + WORDS
        self._per_rank = self._at["rank_header"] + RING * self._slot_words
        nbytes = 8 * size * self._per_rank
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="bccl-", dir="/dev/shm")
            os.ftruncate(fd, nbytes)
            store.set("bccl/board", path)
        else:
            path = store.get("bccl/board").decode()
            fd = os.open(path, os.O_RDWR)
        self._map = mmap.mmap(fd, nbytes)
        os.close(fd)
        # Whoever maps last removes the name; the mapping itself lives until every rank exits.
        if store.add("bccl/board_mapped", 1) == size:
            os.unlink(path)
        self._words = memoryview(self._map).cast("q")
        self._anchor = ctypes.c_char.from_buffer(self._map)  # pins the mapping while its address is used
        self._address = ctypes.addressof(self._anchor)
        self._sleep_on, self._store = core._shared_word_wait, core._shared_word_publish
        # The steps every collective takes (post, settle), and the native launches, go through this.
        self.native = core._SignatureBoard(self._address, rank, size, self._per_rank, RING, WORDS)
        self._base = [r * self._per_rank for r in range(size)]
        self._peers = [r for r in range(size) if r != rank]
        self._words[self._base[rank] + self._at["pid"]] = os.getpid()
        self._my_waiters = self._waiters_of(rank)
        self.sequence = 0  # the last collective this rank posted

    def _slot(self, rank: int, sequence: int) -> int:
        return self._base[rank] + self._at["rank_header"] + (sequence % RING) * self._slot_words

    def _waiters_of(self, rank: int) -> int:
        """Address of the word counting the peers asleep on `rank`'s words."""
        return self._address + 8 * (self._base[rank] + self._at["waiters"])

    def _wait(self, index: int, ready, rank: int, what: str, timeout: Optional[datetime.timedelta] = None) -> int:
        """Returns the board word at `index` (which `rank` writes) once `ready(word)` holds, waiting
        at most `timeout` (the group's timeout when None)."""
        w = self._words
        for _ in range(64):  # a peer already at the collective arrives within microseconds
            observed = w[index]
            if ready(observed):
                return observed
        # Otherwise it is still computing, often on the core this rank would spin on: sleep in
        # the kernel until its write wakes this rank (see _publish), checking now and then that
        # it is still alive and that the timeout has not passed.
        wait, address = self._sleep_on, self._address + 8 * index
        waiters = self._waiters_of(rank)
        limit = timeout or self._timeout
        deadline = time.monotonic() + limit.total_seconds()
        while True:
            observed = w[index]
            if ready(observed):
                return observed
            if wait(address, observed, _LIVENESS_PERIOD, waiters):
                continue
            pid = self._words[self._base[rank] + self._at["pid"]]
            if pid and not _process_alive(pid):
                raise dist.DistBackendError(
                    f"bccl: rank {rank} of group {self._label} (pid {pid}) exited while rank "
                    f"{self._rank} was waiting for it to {what}"
                )
            if time.monotonic() >= deadline:
                # NCCL's watchdog words a timeout this way; tools and tests match on it.
                raise dist.DistBackendError(
                    f"bccl: caught collective operation timeout: timed out after {limit} on group "
                    f"{self._label}: rank {self._rank} waited for rank {rank} to {what}"
                )

    def _publish(self, index: int, value: int) -> None:
        self._store(self._address + 8 * index, value, self._my_waiters)

    def post(self, words: List[int], head: int, launcher=None, operands=()) -> Tuple[int, Optional[int], object]:
        """Post this rank's signature of its next collective; returns (its number, status, work).

        With `head` > 0 the board also decides whether this rank may start at once (status 1 if
        every peer that has posted agrees on the first `head` words, else 0) and posts that
        verdict; with 0 the status is 2 and the caller decides (post_verdict).
        With a `launcher`, the native core checks the operands, posts and starts the collective in
        one call, `launcher(self.native, k, words, head, *operands)`: `work` is gloo's once started,
        and the status is None if it declined the operands (then nothing was posted).
        """
        k = self.sequence + 1
        while True:
            if launcher is None:
                status, work = self.native.post(k, words, head), None
            else:
                try:
                    launched = launcher(self.native, k, words, head, *operands)
                except BaseException:
                    # Posted, then gloo refused to start (an aborted group): k is used all the same.
                    if self._words[self._slot(self._rank, k) + self._at["sequence"]] == k:
                        self.sequence = k
                    raise
                if launched is None:
                    return k, None, None
                status, work = launched
            if status != -1:
                break
            self.wait_for_slot(k)
        self.sequence = k
        return k, status, work

    def wait_for_slot(self, k: int) -> None:
        """Wait until every peer has settled collective k - RING, whose slot collective k reuses
        (a post of k returned -1: a peer is RING collectives behind)."""
        for peer in self._peers:
            self._wait(self._base[peer] + self._at["settled"], lambda settled: settled >= k - RING, peer,
                       f"finish collective #{k - RING}")

    def settle_agreed(self, k: int, head: int) -> int:
        """1 if every peer has posted collective k with the same first `head` words as this rank
        (then k is settled), 0 if all posted and one differs, -1 if one has not posted. No waiting."""
        return self.native.settle_agreed(k, head)

    def signature(self, peer: int, k: int, words: int = WORDS, timeout: Optional[datetime.timedelta] = None) -> List[int]:
        """The first `words` words of `peer`'s signature of collective k, waiting for it to be posted."""
        slot = self._slot(peer, k)
        sequence = slot + self._at["sequence"]
        if self._words[sequence] != k:
            self._wait(sequence, lambda posted: posted == k, peer, f"reach collective #{k}", timeout)
        payload = slot + self._at["slot_header"]
        return self._words[payload : payload + words].tolist()

    def post_verdict(self, k: int, started: bool) -> None:
        self._publish(self._slot(self._rank, k) + self._at["verdict"], 2 * k + int(started))

    def verdict(self, peer: int, k: int, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Whether `peer` started collective k in gloo, waiting for it to decide."""
        word = self._wait(self._slot(peer, k) + self._at["verdict"], lambda verdict: verdict >> 1 == k, peer,
                          f"decide on collective #{k}", timeout)
        return bool(word & 1)

    def settle(self, k: int) -> None:
        """This rank has read its peers' slots for every collective up to k."""
        self._publish(self._base[self._rank] + self._at["settled"], k)

    def close(self) -> None:
        self.native = None  # holds the mapping's address, valid only while the anchor pins it
        self._anchor = None
        try:
            self._words.release()
            self._map.close()
        except (BufferError, ValueError):
            pass


class GlooExchange:
    """Signature all-gather on its own gloo group, for groups that span hosts."""

    launches_early = False  # every collective waits for all signatures before it starts

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        self._size = size
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("bccl/signatures", store), rank, size, timeout)

    def exchange(self, words: List[int]) -> List[List[int]]:
        mine = torch.zeros(WORDS, dtype=torch.int64)
        mine[: len(words)] = torch.tensor(words, dtype=torch.int64)
        everyone = torch.empty(self._size * WORDS, dtype=torch.int64)
        work = self._pg._allgather_base(everyone, mine)
        handoff.hold([work])
        try:
            work.wait()
        except RuntimeError as error:
            # A peer that never comes or went away: NCCL's type for it, not gloo's plain one.
            raise dist.DistBackendError(f"bccl: signature exchange failed: {error}") from error
        return everyone.view(self._size, WORDS).tolist()

    def close(self) -> None:
        pass


def create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, label: str):
    """The cheapest carrier every rank of the group can use (all ranks reach the same choice)."""
    store.set(f"bccl/host/{rank}", _host_identity())
    hosts = {store.get(f"bccl/host/{r}").decode() for r in range(size)}
    if len(hosts) == 1 and os.path.isdir("/dev/shm"):
        return SharedMemoryBoard(store, rank, size, timeout, label)
    return GlooExchange(store, rank, size, timeout)
