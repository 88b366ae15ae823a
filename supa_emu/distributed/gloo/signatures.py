"""What the ranks of a group must agree on before a collective runs, and the error when they do not.

A signature is a list of int64 words:
  [operation, dtype, reduce op, root, total input elements, total output elements, shape digest,
   0, extra...]
The first eight words must be identical on every rank; each collective fills them with only the
facts that must match (for example, all_gather with unequal sizes leaves the input count out and
puts the list of all sizes in the digest). `extra` carries per-rank facts that are checked crosswise:
for all-to-all, each rank's send counts, which must equal what each peer expects to receive.
"""

import collections
import datetime
import threading
import zlib
from typing import Callable, Deque, List, Optional, Sequence

import torch

from .. import collective
from .signature_exchange import RING, WORDS, CollectiveMismatchError

OPERATIONS = tuple(collective.OPERATIONS)  # an op's code is its position
_OPCODE = {name: code for code, name in enumerate(OPERATIONS)}

_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_HEAD = 8
MAX_CROSS_CHECKED_RANKS = WORDS - _HEAD


def digest(numbers: Sequence[int]) -> int:
    """Process-independent checksum of a list of sizes (Python's hash() is salted for str).

    One size is its own digest: the common single-tensor call then costs no checksum.
    """
    if len(numbers) == 1:
        return numbers[0]
    return zlib.crc32(",".join(map(str, numbers)).encode())


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    if dtype is None:
        return -1
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        code = 1000 + zlib.crc32(str(dtype).encode()) % 100000
    return code


def make(
    operation: str,
    dtype: Optional[torch.dtype] = None,
    reduce_op: int = -1,
    root: int = -1,
    numel_in: int = 0,
    numel_out: int = 0,
    shape_digest: int = 0,
    extra: Sequence[int] = (),
) -> List[int]:
    return [_OPCODE[operation], dtype_code(dtype), reduce_op, root, numel_in, numel_out, shape_digest, 0, *extra]


def decode(words: Sequence[int]):
    """(operation, dtype, reduce op, root, input elements, output elements) of a signature."""
    code = words[1]
    dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else None
    return OPERATIONS[words[0]], dtype, words[2], words[3], words[4], words[5]


def _describe(words: Sequence[int]) -> str:
    operation = OPERATIONS[words[0]] if 0 <= words[0] < len(OPERATIONS) else f"operation #{words[0]}"
    fields = []
    if words[1] >= 0:
        fields.append(f"dtype={_DTYPES[words[1]] if words[1] < len(_DTYPES) else words[1]}")
    if words[2] >= 0:
        fields.append(f"op={torch.distributed.ReduceOp.RedOpType(words[2]).name}")
    if words[3] >= 0:
        fields.append(f"root={words[3]}")
    if words[4]:
        fields.append(f"input numel={words[4]}")
    if words[5]:
        fields.append(f"output numel={words[5]}")
    if words[6]:
        fields.append(f"shape digest={words[6]:#x}")
    return f"{operation}({', '.join(fields)})"


def check(everyone: List[List[int]], rank: int, group: str, receive_counts: Sequence[int] = ()) -> None:
    """Raise CollectiveMismatchError naming both sides unless all ranks posted compatible signatures.

    `receive_counts[p]`, when given, is what this rank expects from rank p; it must equal rank p's
    extra word for this rank (its send count to us).
    """
    mine = everyone[rank]
    for peer, theirs in enumerate(everyone):
        if theirs[:_HEAD] != mine[:_HEAD]:
            raise CollectiveMismatchError(
                f"bccl: collective mismatch on group {group}: rank {rank} called {_describe(mine)} "
                f"but rank {peer} called {_describe(theirs)}"
            )
    for peer, expected in enumerate(receive_counts):
        sent = everyone[peer][_HEAD + rank]
        if sent != expected:
            raise CollectiveMismatchError(
                f"bccl: {OPERATIONS[mine[0]]} size mismatch on group {group}: rank {rank} expects "
                f"{expected} elements from rank {peer}, which sends it {sent}"
            )


def _mismatch(everyone: List[List[int]], rank: int, group: str, receive_counts: Sequence[int]):
    try:
        check(everyone, rank, group, receive_counts)
    except CollectiveMismatchError as error:
        return error
    return None


class Ticket:
    """One collective this rank has posted: whether it started it, and what settling it found."""

    __slots__ = ("sequence", "signature", "receive_counts", "started", "settled", "error")

    def __init__(self, sequence: int, signature: List[int], receive_counts: Sequence[int], started: bool):
        self.sequence, self.signature, self.receive_counts = sequence, signature, receive_counts
        self.started, self.settled = started, False
        self.error: Optional[CollectiveMismatchError] = None


def _can_stand_in(signature: List[int]) -> bool:
    """Whether a stand-in could run for `signature`, which an early start needs: it must name the dtype."""
    return signature[1] < len(_DTYPES)


class Agreement:
    """Runs the agreement step of one group: posts this rank's signatures and checks everyone's.

    Over a carrier that waits for all signatures (GlooExchange), a collective starts only once all
    ranks have agreed. Over the shared-memory board, a collective whose signature alone says what
    gloo will run (`early=True`: the single-tensor all_reduce, broadcast, all_gather_into_tensor,
    reduce_scatter_tensor and barrier) starts as soon as its signature matches every signature
    already posted, so the check costs no round trip. Of two ranks, one always sees the other's
    signature (the board publishes with a full fence), so no two ranks that both started disagree.
    A rank that refuses a collective some peers started runs a stand-in with the started signature
    (`stand_in`), which lets their gloo operation finish; they then raise the mismatch from their
    work's wait(), it raises at once, and the group stays usable.
    """

    def __init__(self, exchange, rank: int, size: int, label: str, stand_in: Callable[[List[int]], None]):
        self._exchange, self._rank, self._size, self._label = exchange, rank, size, label
        self._stand_in = stand_in
        self._early = exchange.launches_early
        self._unsettled: Deque[Ticket] = collections.deque()
        self._lock = threading.RLock()
        self._closed: Optional[Exception] = None  # why the group closed, reported by its pending works

    def agree(self, signature: List[int], receive_counts: Sequence[int] = (), early: bool = False) -> Optional[Ticket]:
        """Post `signature`; returns once this rank may start the collective, raising
        CollectiveMismatchError when it must not. A returned ticket is settled by the work's wait().
        """
        if self._size == 1:
            return None
        if not self._early:
            check(self._exchange.exchange(signature), self._rank, self._label, receive_counts)
            return None
        early = early and not receive_counts and _can_stand_in(signature)
        return self._post(signature, receive_counts, early)[0]

    def launch(self, signature: List[int], launcher: Callable, *operands):
        """agree(signature, early=True) and start the collective, in one native call that also
        checks the operands (see SharedMemoryBoard.post): (ticket, gloo's work), or None where that
        path does not apply (no board, one rank, or operands the native core declined, in which
        case nothing was posted), and the caller agrees and starts as usual.
        """
        if self._size == 1 or not self._early or not _can_stand_in(signature):
            return None
        return self._post(signature, (), True, launcher, operands)

    def _post(self, signature: List[int], receive_counts: Sequence[int], early: bool, launcher=None, operands=()):
        board = self._exchange
        with self._lock:
            if self._unsettled:  # usually empty: the works were waited for
                self._settle_posted()
            while self._unsettled and self._unsettled[0].sequence <= board.sequence + 1 - RING:
                self._settle(self._unsettled[0])  # frees the ring slot this collective will use
            k, status, work = board.post(signature, _HEAD if early else 0, launcher, operands)
            if status is None:
                return None
            if status == 2:  # wait for every signature, then decide
                everyone = [signature if r == self._rank else board.signature(r, k) for r in range(self._size)]
                started = _mismatch(everyone, self._rank, self._label, receive_counts) is None
                board.post_verdict(k, started)
            else:
                started = status == 1
            ticket = Ticket(k, signature, receive_counts, started)
            self._unsettled.append(ticket)
            if not started:
                self.settle(ticket)
                raise ticket.error
            if not early:
                self.settle(ticket)  # every signature is in already: nothing left to check later
                return None, work
            return ticket, work

    def settle(self, ticket: Optional[Ticket], timeout: Optional[datetime.timedelta] = None) -> Optional[CollectiveMismatchError]:
        """Check `ticket` (and every earlier one) against all peers' signatures, waiting for them at
        most `timeout` each (the group's timeout when None); returns the mismatch its collective
        ran into, if any."""
        if ticket is None:
            return None
        if self._closed is not None and not ticket.settled:
            return self._closed
        with self._lock:
            while not ticket.settled:
                self._settle(self._unsettled[0], timeout)
        return ticket.error

    def settled_error(self, ticket: Optional[Ticket]):
        """`ticket`'s mismatch if all its signatures are already posted; never waits. Returns
        (known, error)."""
        if ticket is None or ticket.settled:
            return True, ticket.error if ticket else None
        if self._closed is not None:
            return True, self._closed
        if not self._lock.acquire(blocking=False):
            return False, None
        try:
            self._settle_posted()
            return ticket.settled, ticket.error
        finally:
            self._lock.release()

    def _settle_posted(self) -> None:
        while self._unsettled and self._settle_if_posted(self._unsettled[0]):
            pass

    def _settle_if_posted(self, ticket: Ticket) -> bool:
        """Settle `ticket` (the oldest) if all peers have posted it; never waits."""
        if not ticket.started or ticket.receive_counts:
            return False
        agreed = self._exchange.settle_agreed(ticket.sequence, _HEAD)
        if agreed == 1:  # the common case, all in one native call
            ticket.settled = True
            self._unsettled.popleft()
            return True
        if agreed == 0:
            self._settle_waiting(ticket)  # names the mismatch
            return True
        return False

    def _settle(self, ticket: Ticket, timeout: Optional[datetime.timedelta] = None) -> None:
        if not self._settle_if_posted(ticket):
            self._settle_waiting(ticket, timeout)

    def _settle_waiting(self, ticket: Ticket, timeout: Optional[datetime.timedelta] = None) -> None:
        board, k = self._exchange, ticket.sequence
        words = WORDS if ticket.receive_counts else _HEAD  # the rest only carries cross-checked counts
        everyone = [ticket.signature if r == self._rank else board.signature(r, k, words, timeout)
                    for r in range(self._size)]
        ticket.error = _mismatch(everyone, self._rank, self._label, ticket.receive_counts)
        if ticket.error is not None and not ticket.started:
            starters = [r for r in range(self._size) if r != self._rank and board.verdict(r, k, timeout)]
            if starters:
                self._stand_in(everyone[starters[0]])
        board.settle(k)
        ticket.settled = True
        self._unsettled.popleft()

    def agree_all_to_all(self, operation: str, dtype, send: List[int], receive: List[int]) -> Optional[Ticket]:
        """Like `agree`, and each rank's send count to every peer must be what that peer receives."""
        if self._size == 1:
            return None
        if self._size > MAX_CROSS_CHECKED_RANKS:
            # Too many ranks to post every send count: check only what all ranks share.
            return self.agree(make(operation, dtype))
        return self.agree(make(operation, dtype, extra=send), receive)

    def close(self, reason: Optional[Exception] = None) -> None:
        """Close the carrier; works still unsettled report `reason` (DistBackendError by default)."""
        self._closed = reason or torch.distributed.DistBackendError(f"bccl: group {self._label} was closed")
        self._exchange.close()
