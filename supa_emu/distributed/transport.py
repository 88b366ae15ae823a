"""The seam between ProcessGroupBCCL and what carries its calls: the part a different world replaces.

The group checks each call and describes it in one record (collective.py); its transport carries
it. Between real ranks that is gloo (the gloo/ package, registered as bccl's transport by
supa_emu.distributed.register). The planner, whose world has one real rank, installs its own
(supa_emu.distributed.install_transport). A transport method takes the checked record and
returns the call's work, started; it never checks operands again, and it reports nothing: the
group names the call to the profiler, the checkers and the watchers. Transports reach the
tensors' memory through host_memory.py.
"""

import abc
from typing import Callable, List, Optional

import torch.distributed as dist

from .collective import Collective
from .work import BCCLWork


class Transport(abc.ABC):
    """One group's transport, made by a factory `(store, rank, size, options, label)`."""

    # ---- reductions ------------------------------------------------------------------------------
    @abc.abstractmethod
    def all_reduce(self, call: Collective) -> BCCLWork:
        """Reduce the one tensor in place on every rank."""

    @abc.abstractmethod
    def all_reduce_coalesced(self, call: Collective) -> BCCLWork:
        """all_reduce of each tensor, as one call."""

    @abc.abstractmethod
    def reduce(self, call: Collective) -> BCCLWork:
        """Reduce into the root's tensor; the others' stay intact."""

    @abc.abstractmethod
    def reduce_scatter(self, call: Collective) -> BCCLWork:
        """The list form: rank r's output is the reduction of every rank's inputs[r]."""

    @abc.abstractmethod
    def reduce_scatter_tensor(self, call: Collective) -> BCCLWork:
        """For each pair (one, or several when coalesced): rank r's output is the reduction of
        every rank's r-th chunk of its input."""

    # ---- data movement ---------------------------------------------------------------------------
    @abc.abstractmethod
    def broadcast(self, call: Collective) -> BCCLWork:
        """Every rank's tensor becomes the root's."""

    @abc.abstractmethod
    def all_gather(self, call: Collective) -> BCCLWork:
        """The list form: outputs[r] becomes rank r's input."""

    @abc.abstractmethod
    def all_gather_into_tensor(self, call: Collective) -> BCCLWork:
        """For each pair (one, or several when coalesced): chunk r of the output becomes rank r's input."""

    @abc.abstractmethod
    def gather(self, call: Collective) -> BCCLWork:
        """The root's outputs[r] becomes rank r's input."""

    @abc.abstractmethod
    def scatter(self, call: Collective) -> BCCLWork:
        """Rank r's output becomes the root's inputs[r]."""

    @abc.abstractmethod
    def all_to_all(self, call: Collective) -> BCCLWork:
        """The list form: outputs[r] becomes rank r's inputs[this rank]."""

    @abc.abstractmethod
    def all_to_all_single(self, call: Collective) -> BCCLWork:
        """The output's r-th split becomes rank r's input split for this rank (`call.counts`)."""

    # ---- synchronisation and point-to-point ------------------------------------------------------
    @abc.abstractmethod
    def barrier(self, call: Collective) -> BCCLWork:
        """Completes once every rank has entered it."""

    @abc.abstractmethod
    def send(self, call: Collective) -> BCCLWork:
        """The tensor to rank `call.peer` under `call.tag`."""

    @abc.abstractmethod
    def recv(self, call: Collective) -> BCCLWork:
        """Into the tensor from rank `call.peer` (None: any) under `call.tag`."""

    # ---- the group's life ------------------------------------------------------------------------
    @abc.abstractmethod
    def exchange_split(self, store: dist.Store, prefix: str, members: Optional[List[int]]) -> List[Optional[List[int]]]:
        """This rank joins subgroup `members` (None: none) of a split: post it, and return what every
        rank of the group posted, by rank (the group checks that they fit together)."""

    @abc.abstractmethod
    def close(self, how: str, error: dist.DistBackendError) -> None:
        """The group was "aborted" or "shut down": release the peers; works still pending report `error`."""


Factory = Callable[[dist.Store, int, int, object, str], Transport]
