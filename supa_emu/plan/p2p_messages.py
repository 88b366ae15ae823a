"""Point-to-point messages between the played ranks of a plan, through the plan's shared directory.

The uniform-rank rule answers collectives, but a point-to-point message carries what one rank
computed for another: pipeline stages send activations and, before them, the shapes they will
exchange (torch.distributed.pipelining pickles them with send_object_list: an int64 size, then
uint8 bytes), forward and backward. So a planned rank's send is kept in a message log, and a
played rank's recv from a played peer takes the message its peer sent:

- a message is keyed by (group name, global source, global destination, tag, its number among
  that pair's messages of that tag), as a real channel delivers them in order;
- what is kept: values a program may read as sizes or objects (integer and bool tensors, any
  size) and small values (at most ROOT_VALUE_LIMIT bytes, as small broadcasts); a larger float
  message (activations, gradients) keeps the receiver's buffer, which memory does not depend on;
- a recv from a played peer whose message is not there yet waits for it: the planner starts the
  peer if it has not started (rank 0 runs alone until it waits, so stages that send both ways,
  as pipelining's warm-up and metadata exchange do, run side by side; see play_order.py);
- with all-stages, any send to or recv from a peer asks the planner to play that peer, whether
  or not its message is kept: a pipeline whose stages exchange only large activations and
  gradients (Megatron-core's, at a fixed sequence length) never waits for a message, and its
  next stage must be played all the same;
- a recv from a rank the plan does not play keeps its buffer for float data (flagged, as before),
  and fails the rank with the call site for data a program reads as sizes or objects: guessing
  those would read left-over card memory as a size.

The files are the plan's shared directory's (plan_directory.py); the planner's side is play_order.py.
"""

import os
import traceback
from typing import Callable, Dict, Optional, Tuple

import torch

from supa_emu.plan import call_record, p2p_time, rank_record, world
from supa_emu.plan.plan_directory import PlanDirectory, Wait, message_name
from supa_emu.plan.plan_error import PlanError

_directory: Optional[PlanDirectory] = None
_rank: Optional[int] = None
_played = None  # the set of ranks the plan plays, or None: any peer may be played (all-stages)
_counts: Dict[Tuple, int] = {}
_planner: Optional[int] = None  # the planner's process id: a rank stops waiting when it is gone
_met = set()  # the peers this rank asked the planner to play (all-stages)


def open_log(directory: str, rank: int) -> None:
    """This process plays `rank` and exchanges its messages in `directory` (the plan's shared one)."""
    global _directory, _rank, _played, _planner
    _directory, _rank, _planner = PlanDirectory(directory), rank, os.getppid()
    _played = _directory.played()


def peer_posts():
    """This rank's p2p_time.PeerPosts (its side of each transfer's time, through the same directory), or
    None outside a plan."""
    if _directory is None:
        return None
    return p2p_time.PeerPosts(_directory.path, _rank, _played, _planner, world.save_root_values)


def carried(tensor: torch.Tensor) -> bool:
    """Whether a message of `tensor`'s kind is kept for its receiver (see above)."""
    return (not (tensor.is_floating_point() or tensor.is_complex())
            or tensor.numel() * tensor.element_size() <= world.ROOT_VALUE_LIMIT)


def _numbered(group: str, source: int, destination: int, tag: int, direction: str) -> str:
    key = (group, source, destination, tag, direction)
    _counts[key] = _counts.get(key, 0) + 1
    return message_name(group, source, destination, tag, _counts[key])


def send(group: str, source: int, destination: int, tag: int, host: torch.Tensor) -> None:
    """Logs the message `host` (the sent tensor's host memory) for its receiver, if it is kept."""
    name = _numbered(group, source, destination, tag, "sent")
    _meet(destination)
    if _directory is not None and carried(host):
        _directory.write_message(name, lambda path: torch.save(host.clone(), path))


def receive(group: str, source: Optional[int], destination: int, tag: int,
            like: torch.Tensor) -> Callable[[], Optional[torch.Tensor]]:
    """A recv into a tensor like `like` (its host memory), numbered when issued: the function that
    gives what `source` sent once the recv is waited for (waiting for it if its sender is played and
    has not sent it yet), or None where the buffer keeps its contents."""
    if source is None:
        return _unknown(like, "a receive from any source")
    name = _numbered(group, source, destination, tag, "received")
    _meet(source)
    if not carried(like):
        call_record.flag("recv: a large float message (activations, gradients) keeps the buffer's contents; "
                         "memory does not depend on them")
        return lambda: None
    if _directory is None or (_played is not None and source not in _played):
        return _unknown(like, f"rank {source}, which this plan does not play")

    def message() -> torch.Tensor:
        sent = _wait(name, source)
        if sent.dtype != like.dtype or sent.numel() != like.numel():
            raise PlanError(f"planner: rank {destination} receives {like.numel()} {_dtype(like)} from rank "
                            f"{source} at {_call_site()}, which sent {sent.numel()} {_dtype(sent)}")
        return sent

    return message


def _meet(peer: int) -> None:
    """With all-stages, asks the planner (once) to play `peer`, which this rank exchanges messages with."""
    if _directory is None or _played is not None or peer == _rank or peer in _met:
        return
    world.save_root_values()  # the peer may start now: give it the broadcasts made so far
    _directory.want(peer)
    _met.add(peer)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def _unknown(like: torch.Tensor, sender: str) -> Callable[[], None]:
    """A recv whose message is not known: float data keeps the buffer (flagged); what a program reads
    as sizes or objects fails the rank, since the buffer holds left-over card memory."""
    if like.is_floating_point() or like.is_complex():
        call_record.flag("recv: the data another rank sends is not known; the buffer keeps its contents")
        return lambda: None
    raise PlanError(
        f"planner: rank {_rank} receives {_dtype(like)} data (sizes or a pickled object) from {sender}, at "
        f"{_call_site()}: its content cannot be known; play the sender too (--rank with a list, or --rank all-stages)")


def _call_site() -> str:
    """The user's line and the innermost frame outside torch.distributed's c10d and the emulator."""
    frames = [{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(traceback.extract_stack())]
    inner = [f for f in frames if "/supa_emu/" not in f["filename"] and "/torch/distributed/distributed_c10d" not in
             f["filename"] and "/torch/distributed/c10d_logger" not in f["filename"]]
    return rank_record.site(inner)


def _wait(name: str, source: int) -> torch.Tensor:
    """The message `name` from played rank `source`, once it is there (the planner starts `source`
    if it has not started); a PlanError if `source` ended without it or every played rank waits."""

    def look() -> Optional[bool]:
        ended = _directory.ended(source)  # before the look: a rank that ended has sent all it sends
        if _directory.delivered(name):
            return True
        if ended:
            raise PlanError(f"planner: rank {_rank} waits at {_call_site()} for a message from rank {source} "
                            f"({name}), which ended without sending it")
        if _directory.stalled():
            raise PlanError(f"planner: rank {_rank} waits at {_call_site()} for a message from rank {source} "
                            f"({name}) while every played rank waits for another: the program's sends and "
                            f"receives do not match")
        return None

    # the peer may start once this rank waits: give it the broadcasts made so far
    _directory.wait(_rank, Wait(source, message=name), look, _planner, world.save_root_values)
    return torch.load(_directory.message(name))
