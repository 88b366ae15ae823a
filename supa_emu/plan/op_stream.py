"""What a planned rank launches on its card, in order, handed to the time model as it goes.

The native core records every operator launched on the card (csrc/runtime/op_trace.h: the
dispatcher's observer hook, in both planner modes), the event records and waits of the program's
streams and its synchronisations. This module adds, in the same order, a mark for each bccl
collective (with its bytes, group size, the hosts its ranks span, its communicator and whether it
was issued with async_op; for a send or recv, the peer's global rank and the transfer's number on
its channel, p2p_time.py), one where the program waits for a collective's work, and one at the end of each
training step: the end of an optimizer's `step` (torch.optim's global hooks, the outermost one
where optimizers nest), so DeepSpeed's, FSDP's and torchtitan's loops need no change. At each
step's end the stream recorded so far goes to the time model (time_model.py), so the record
stays small however long the script runs.

`supa_emu.plan.tokens(n)` says how many tokens a step trains (per rank), for tokens/s.
"""

from typing import Optional

import torch

from supa_emu import distributed, process_state
from supa_emu.device_type import DEVICE_TYPE
from supa_emu.plan import p2p_messages, p2p_time, time_model

STEP_MARK = -1

_schedule: Optional[time_model.Schedule] = None
_collectives: list = []
_hosts_of_group: dict = {}
_cards_per_host = 8
_optimizer_depth = 0
_transfers: dict = {}  # (group, global source, global destination) -> transfers issued on it


class _CollectiveMarks(distributed.Watcher):
    def collective_issued(self, group, call, work) -> None:
        if group.kind.device_type != DEVICE_TYPE:
            return  # a host (gloo) group's call: the card takes no part in it
        read = written = 0
        for tensor, reads, writes in call.accesses():
            size = tensor.numel() * tensor.element_size()
            read += size if reads else 0
            written += size if writes else 0
        cards = [tensor.device for tensor, _, _ in call.accesses() if tensor.device.type == "supa"]
        card = cards[0] if cards else torch.device("supa", torch.supa.current_device())
        transfer = _transfer(group, call)
        size, hosts = (group.size(), _hosts(group)) if transfer is None else (2, _pair_hosts(transfer))
        mark = _mark(card, time_model.Collective(call.op, max(read, written), size, hosts,
                                                 _communicator(group, call, card), _asynchronous(call), transfer))
        barrier = call.op == "barrier"  # the callback keeps no tensor of the call
        work.when_waited(lambda: _mark(card, time_model.Waited(mark, barrier)))


def _mark(card: torch.device, record) -> int:
    """Marks `record` (a collective, or a wait for one) on the current stream of `card`: its index."""
    _collectives.append(record)
    with torch.supa.device(card):
        process_state.core()._op_trace_mark(len(_collectives) - 1)
    return len(_collectives) - 1


def _communicator(group, call, card: torch.device) -> str:
    """The communicator `call` runs on, as c10d's NCCL group keys them: the group's on a card, or for
    point-to-point the pair of peers' own (one stream each)."""
    name = f"{getattr(group, 'group_name', None) or id(group)}:{card.index}"
    if call.op in ("send", "recv"):
        peer = "any" if call.peer is None else call.peer
        low, high = sorted((group.rank(), peer)) if peer != "any" else (group.rank(), peer)
        return f"group {name} p2p {low}:{high}"
    return f"group {name}"


def _transfer(group, call) -> Optional[p2p_time.Transfer]:
    """A send's or a recv's channel (group, global sender, global receiver) and its number on it, counted
    in program order as NCCL matches a pair's calls; None for other calls and a recv from any source."""
    if call.op not in ("send", "recv") or call.peer is None:
        return None
    ranks = group.options.global_ranks_in_group or range(group.size())
    me, peer = ranks[group.rank()], ranks[call.peer]
    source, destination = (me, peer) if call.op == "send" else (peer, me)
    channel = (str(group.group_name), source, destination)
    _transfers[channel] = _transfers.get(channel, 0) + 1
    return p2p_time.Transfer(*channel, _transfers[channel], call.op == "send")


def _pair_hosts(transfer: p2p_time.Transfer) -> int:
    """How many hosts a transfer's two ranks span: it takes their link, whatever group it is on."""
    return len({transfer.source // _cards_per_host, transfer.destination // _cards_per_host})


def _asynchronous(call) -> bool:
    """Whether `call` runs on its communicator's stream: c10d passes async_op as the options' asyncOp
    (its default, true, for callers that pass no options: DDP's reducer); point-to-point has none
    and always does."""
    return bool(getattr(call.options, "asyncOp", True))


def _hosts(group) -> int:
    """How many hosts the group's ranks span (the world's layout: cards_per_host ranks per host)."""
    key = id(group)
    if key not in _hosts_of_group:
        from torch.distributed import distributed_c10d

        try:
            ranks = distributed_c10d.get_process_group_ranks(group)
        except (RuntimeError, ValueError, KeyError):  # a group c10d does not know: its ranks are consecutive
            ranks = range(group.size())
        _hosts_of_group[key] = len({r // _cards_per_host for r in ranks})
    return _hosts_of_group[key]


def _optimizer_entered(optimizer, args, kwargs) -> None:
    global _optimizer_depth
    _optimizer_depth += 1


def _optimizer_done(optimizer, args, kwargs) -> None:
    global _optimizer_depth
    _optimizer_depth = max(0, _optimizer_depth - 1)
    if _optimizer_depth == 0:
        step_done()


def start(settings: dict) -> None:
    """Records this rank's launches and times them with `settings` (time_model.Schedule's)."""
    global _schedule, _cards_per_host
    _cards_per_host = settings["cards_per_host"]
    _schedule = time_model.Schedule.from_settings(settings, p2p_messages.peer_posts())
    distributed.watch(_CollectiveMarks())
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_optimizer_entered)
    register_optimizer_step_post_hook(_optimizer_done)
    process_state.core()._op_trace_enable(True)


def recording() -> bool:
    return _schedule is not None


def _drain() -> None:
    core = process_state.core()
    _schedule.feed(core._op_trace_take(), core._op_trace_names(), _collectives)


def step_done() -> None:
    """Ends a training step: what was launched so far belongs to it."""
    if _schedule is None:
        return
    process_state.core()._op_trace_mark(STEP_MARK)
    _drain()


def tokens(n: int) -> None:
    """The tokens each step trains on this rank, from the next step's end on."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TypeError(f"tokens(n): n must be a non-negative int (tokens per step on this rank), got {n!r}")
    if _schedule is not None:
        _schedule.tokens_per_step = n


def finish() -> Optional[dict]:
    """This rank's time report (time_model.Schedule.report), or None when nothing was recorded."""
    if _schedule is None:
        return None
    process_state.core()._op_trace_enable(False)
    _drain()
    return _schedule.report()


def trace_events() -> list:
    return _schedule.trace_events() if _schedule is not None else []
