"""Cross-rank agreement check run before every bccl collective, so a mismatch raises instead of crashing.

Gloo trusts every rank to pass the same sizes: when a peer sends more bytes than a rank expects,
gloo aborts the process from its I/O thread, and fewer bytes leave garbage or a hang. bccl therefore
has each rank publish a short signature of the collective it is about to run (operation, dtype,
element counts, root, reduction) and compare all signatures before any gloo traffic starts.

Two carriers, same contract (`exchange(words) -> one word list per rank`):
- `SharedMemoryBoard` when all ranks of the group share a host (the emulator's normal case): a
  small /dev/shm ring per group, costing microseconds, so checks do not slow collectives down.
  It watches peer process ids so a dead rank fails the wait at once rather than at the timeout.
- `GlooExchange` otherwise: one small all-gather on a separate gloo group.
"""

import array
import ctypes
import datetime
import mmap
import os
import socket
import tempfile
import time
from typing import List

import torch
import torch.distributed as dist

from supa_emu.supa import _native

from . import gloo_handoff

WORDS = 64  # signature payload per rank per collective, in int64 words
_RING = 256  # collectives a rank may run ahead of its slowest peer before it waits
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

    Layout (int64 words): for each rank, a header [pid, consumed] followed by _RING slots of
    [sequence, payload...]. Rank r publishes collective k in slot k % _RING, waits for every peer's
    slot to carry k, reads them, then advances its `consumed` to k. It reuses a slot only once all
    peers have consumed the collective that last used it.
    """

    _HEADER = 2
    _SLOT = 1 + WORDS

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, label: str):
        self._rank, self._size, self._timeout, self._label = rank, size, timeout, label
        self._per_rank = self._HEADER + _RING * self._SLOT
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
        core = _native()
        self._sleep_on, self._wake = core._shared_word_wait, core._shared_word_wake
        self._base = [r * self._per_rank for r in range(size)]
        self._words[self._base[rank]] = os.getpid()
        self._sequence = 0

    def _slot(self, rank: int, sequence: int) -> int:
        return self._base[rank] + self._HEADER + (sequence % _RING) * self._SLOT

    def _wait(self, index: int, ready, rank: int, what: str) -> None:
        """Returns once `ready(word)` holds for the board word at `index`, which `rank` writes."""
        w = self._words
        for _ in range(64):  # a peer already at the collective arrives within microseconds
            if ready(w[index]):
                return
        # Otherwise it is still computing, often on the core this rank would spin on: sleep in
        # the kernel until its write wakes this rank (see _publish), checking now and then that
        # it is still alive and that the timeout has not passed.
        wait, address = self._sleep_on, self._address + 8 * index
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            observed = w[index]
            if ready(observed):
                return
            if wait(address, observed, _LIVENESS_PERIOD):
                continue
            pid = self._words[self._base[rank]]
            if pid and not _process_alive(pid):
                raise RuntimeError(
                    f"bccl: rank {rank} of group {self._label} (pid {pid}) exited while rank "
                    f"{self._rank} was waiting for it to {what}"
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"bccl: timed out after {self._timeout} on group {self._label}: rank "
                    f"{self._rank} waited for rank {rank} to {what}"
                )

    def _publish(self, index: int, value: int) -> None:
        self._words[index] = value
        self._wake(self._address + 8 * index)

    def exchange(self, words: List[int]) -> List[List[int]]:
        self._sequence += 1
        k, me, w = self._sequence, self._rank, self._words
        for peer in range(self._size):
            if peer != me:
                self._wait(self._base[peer] + 1, lambda consumed: consumed >= k - _RING, peer,
                           f"finish collective #{k - _RING}")
        mine = self._slot(me, k)
        w[mine + 1 : mine + 1 + WORDS] = _pack(words)
        self._publish(mine, k)
        result = []
        for peer in range(self._size):
            slot = self._slot(peer, k)
            if peer != me:
                self._wait(slot, lambda sequence: sequence == k, peer, f"reach collective #{k}")
            result.append(w[slot + 1 : slot + 1 + WORDS].tolist())
        self._publish(self._base[me] + 1, k)
        return result

    def close(self) -> None:
        self._anchor = None
        try:
            self._words.release()
            self._map.close()
        except (BufferError, ValueError):
            pass


def _pack(words: List[int]) -> memoryview:
    if len(words) > WORDS:
        raise ValueError(f"bccl: a signature holds at most {WORDS} words, got {len(words)}")
    return memoryview(array.array("q", words + [0] * (WORDS - len(words))))


class GlooExchange:
    """Signature all-gather on its own gloo group, for groups that span hosts."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        self._size = size
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore("bccl/signatures", store), rank, size, timeout)

    def exchange(self, words: List[int]) -> List[List[int]]:
        mine = torch.zeros(WORDS, dtype=torch.int64)
        mine[: len(words)] = torch.tensor(words, dtype=torch.int64)
        everyone = torch.empty(self._size * WORDS, dtype=torch.int64)
        work = self._pg._allgather_base(everyone, mine)
        gloo_handoff.hold([work])
        work.wait()
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
