"""What the ranks of a group must agree on before a collective runs, and the error when they do not.

A signature is a list of int64 words:
  [operation, dtype, reduce op, root, total input elements, total output elements, shape digest,
   0, extra...]
The first eight words must be identical on every rank; each collective fills them with only the
facts that must match (for example, all_gather with unequal sizes leaves the input count out and
puts the list of all sizes in the digest). `extra` carries per-rank facts that are checked crosswise:
for all-to-all, each rank's send counts, which must equal what each peer expects to receive.
"""

import zlib
from typing import List, Optional, Sequence

import torch

from .signature_exchange import WORDS, CollectiveMismatchError

OPERATIONS = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "all_gather_into_tensor_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)
_OPCODE = {name: code for code, name in enumerate(OPERATIONS)}

_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
_HEAD = 8
MAX_CROSS_CHECKED_RANKS = WORDS - _HEAD


def digest(numbers: Sequence[int]) -> int:
    """Process-independent checksum of a list of sizes (Python's hash() is salted for str)."""
    return zlib.crc32(",".join(map(str, numbers)).encode())


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    if dtype is None:
        return -1
    return _DTYPE_CODE.get(dtype, 1000 + digest([ord(c) for c in str(dtype)]) % 100000)


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


class Agreement:
    """Runs the agreement step of one group: exchanges this rank's signature and checks everyone's."""

    def __init__(self, exchange, rank: int, size: int, label: str):
        self._exchange, self._rank, self._size, self._label = exchange, rank, size, label

    def agree(self, signature: List[int], receive_counts: Sequence[int] = ()) -> None:
        """Raise CollectiveMismatchError unless every rank is about to run the same collective."""
        if self._size == 1:
            return
        check(self._exchange.exchange(signature), self._rank, self._label, receive_counts)

    def agree_all_to_all(self, operation: str, dtype, send: List[int], receive: List[int]) -> None:
        """Like `agree`, and each rank's send count to every peer must be what that peer receives."""
        if self._size == 1:
            return
        if self._size > MAX_CROSS_CHECKED_RANKS:
            # Too many ranks to post every send count: check only what all ranks share.
            self.agree(make(operation, dtype))
            return
        self.agree(make(operation, dtype, extra=send), receive)

    def close(self) -> None:
        self._exchange.close()
