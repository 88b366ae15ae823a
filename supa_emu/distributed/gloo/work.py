"""The gloo transport's works: a bccl work that checks its peers' signatures and hands its parts back to gloo's keeper.

A collective that started before every peer had posted its signature (signatures.Agreement) is
checked against them when it is waited for, before and after gloo's parts; a mismatch is its
outcome. gloo reports a timed-out or broken connection as a plain RuntimeError, which this work
raises as NCCL's type (DistBackendError), so code written for NCCL catches it. Parts that were
waited for go back to gloo's keeper (handoff.py) at that point of the program, and a work whose
group closed before it completed fails at once while the keeper holds its tensors for gloo.
"""

import datetime
from typing import Optional

import torch.distributed as dist

from ..work import BCCLWork
from . import handoff


class GlooWork(BCCLWork):
    def __init__(self, parts, epilogue=None, outputs=(), keep_alive=(), agreement=None, ticket=None):
        super().__init__(parts, epilogue, outputs, keep_alive)
        self._agreement, self._ticket = agreement, ticket
        self.keeps_parts = False  # True: a recv from any source, whose gloo part knows the sender

    def _check_peers(self, limit: Optional[datetime.timedelta]) -> Optional[BaseException]:
        # The peers' signatures first: a dead or stalled peer is reported as such, not as gloo's hang.
        return self._agreement.settle(self._ticket, limit) if self._ticket is not None else None

    def _peers_known(self) -> bool:
        # Once gloo finished, every peer has posted (it posts before it sends), except under a
        # broadcast root: then wait() checks.
        if self._ticket is None:
            return True
        known, mismatch = self._agreement.settled_error(self._ticket)
        if mismatch is not None:
            self._fail(mismatch)
        return known

    def _wait_parts(self, limit: Optional[datetime.timedelta]) -> None:
        try:
            super()._wait_parts(limit)
        except RuntimeError as error:
            if isinstance(error, dist.DistError):
                raise
            raise dist.DistBackendError(f"bccl: {error}") from error

    def _parts_waited(self) -> None:
        if self.keeps_parts:
            handoff.release_finished()
            return
        # The device memory the parts' views keep goes back now, at this point of the program,
        # rather than when gloo, a later collective or this handle lets go.
        parts, self._parts = self._parts, []
        handoff.release_now(parts)

    def abandon(self, error: BaseException) -> None:
        """The group closed (abort, shutdown) before this work completed: it fails with `error` now,
        as NCCL's pending works do, instead of waiting for gloo, which may never finish it. gloo's
        parts keep the device tensors they may still write into (handoff.keep_with)."""
        with self._lock:
            if self._done or all(part.is_completed() for part in self._parts):
                return  # finished before the group closed: its outcome stands
            handoff.keep_with(self._parts, self._keep_alive)
            self._parts = []
            self._ticket = None
            self._fail(error)

    def _source_rank(self) -> int:
        # Only meaningful for recv from any source, which is a single gloo part.
        return self._parts[0]._source_rank()

    def source_rank(self) -> int:
        return self._source_rank()
