"""Point-to-point operations whose peer is the calling rank itself.

NCCL (and BCCL) accept a send to and a receive from one's own rank, typically as two entries of a
batch_isend_irecv that exchanges with every rank including itself; gloo has no connection to
itself and refuses. Here a send to self keeps a snapshot of its tensor under its tag, as the
data a real send would have put on the wire when issued, and the receive with that tag copies
it in when it is waited for (the receive may be issued first, as long as its send is issued
before anyone waits for it). Messages of one tag arrive in the order they were sent.
"""

import collections
import threading
from typing import Deque, Dict

import torch

from ..work import BCCLWork


class SelfMailbox:
    """One group's messages from this rank to itself, by tag."""

    def __init__(self, label: str):
        self._label = label
        self._messages: Dict[int, Deque[torch.Tensor]] = collections.defaultdict(collections.deque)
        self._lock = threading.Lock()

    def send(self, tensor: torch.Tensor, tag: int) -> BCCLWork:
        with self._lock:
            self._messages[tag].append(tensor.detach().clone())
        return BCCLWork([])

    def recv(self, tensor: torch.Tensor, tag: int) -> BCCLWork:
        def deliver():
            with self._lock:
                queue = self._messages.get(tag)
                message = queue.popleft() if queue else None
            if message is None:
                raise RuntimeError(
                    f"bccl: a receive from this rank itself (tag {tag}, group {self._label}) was waited "
                    "for before its matching send was issued; issue the send first (e.g. both in one "
                    "batch_isend_irecv)")
            if message.shape != tensor.shape or message.dtype != tensor.dtype:
                raise RuntimeError(
                    f"bccl: a receive from this rank itself expects {tuple(tensor.shape)} {tensor.dtype}, "
                    f"its send (tag {tag}) sent {tuple(message.shape)} {message.dtype}")
            tensor.copy_(message)

        return BCCLWork([], deliver, [tensor])
