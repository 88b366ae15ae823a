"""Happens-before between SUPA streams and the access history of device memory: the race checks
behind the stream sanitizer (`torch.supa._sanitizer`), with no knowledge of operators.

Every stream counts the kernels queued on it; a stream also knows, for every other stream, up to
which of its kernels it is ordered after (a vector clock). Event records snapshot that knowledge,
event waits merge it, host synchronisation publishes a stream's progress to the host, and the host
hands what it knows to every stream it queues work on afterwards. Memory is tracked per storage
(by its base address, as the caching allocator hands out whole blocks): the last write and, per
stream, the last read since. An access on stream S conflicts with an earlier one on stream T when
S does not know T's kernel yet.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

Stream = object  # a stream key: the stream id, or a tuple naming a virtual stream (collectives)


HOST = "host"  # the CPU, as one more stream: it touches pinned memory that async copies use


def stream_name(stream: Stream) -> str:
    if stream == HOST:
        return "the host (CPU code)"
    if stream == 0:
        return "the default stream (supa_stream 0x0)"
    if isinstance(stream, int):
        return f"stream supa_stream={stream:#x}"
    if isinstance(stream, tuple) and stream and stream[0] == "bccl":
        return f"the bccl communication stream of process group {stream[1]}"
    return str(stream)


# Frames of the dispatch machinery and of the sanitizer itself, left out of reported stacks.
_MACHINERY = ("supa_emu/supa/_sanitizer.py", "supa_emu/supa/_memcheck.py", "torch/_compile.py",
              "torch/_dynamo/eval_frame.py", "torch/utils/_python_dispatch.py")


@dataclasses.dataclass
class Access:
    stream: Stream
    seq: int  # the kernel's number on its stream
    is_write: bool
    operator: str
    tensor: tuple  # (argument name, shape, dtype, device index) of the tensor the operator saw
    stack: object  # a CapturedTraceback; formatted only when a report is made

    def describe(self) -> str:
        kind = "write" if self.is_write else "read"
        name, shape, dtype, device = self.tensor
        where = f"supa:{device}" if device >= 0 else "pinned host memory"
        return (f"{kind} by {self.operator} of argument '{name}' (shape {list(shape)}, {dtype}, {where}) "
                f"on {stream_name(self.stream)}")

    def formatted_stack(self) -> str:
        return format_stack(self.stack)


def format_stack(stack) -> str:
    """A CapturedTraceback as report lines, without the dispatch machinery's frames (shared by
    the stream sanitizer's and the memory checker's reports)."""
    if stack is None:
        return "    (no stack recorded)\n"
    frames = [frame for frame in stack.format() if not any(part in frame for part in _MACHINERY)]
    return "".join(frames)


class StreamRaceError(RuntimeError):
    """Two accesses to the same device memory on different streams with no ordering between them."""

    def __init__(self, data_ptr: int, current: Access, previous: Access):
        self.data_ptr, self.current, self.previous = data_ptr, current, previous
        self.streams = (current.stream, previous.stream)
        super().__init__(
            f"SUPA stream sanitizer: data race between streams on the tensor at data_ptr {data_ptr:#x}\n"
            f"  now:      {current.describe()}\n"
            f"  earlier:  {previous.describe()}\n"
            f"nothing orders the earlier access before this one (no wait_stream, Event.record/wait, "
            f"synchronize or Work.wait() between the two streams); on a SUPA card they can overlap.\n"
            f"Stack of this access:\n{current.formatted_stack()}"
            f"Stack of the earlier access:\n{previous.formatted_stack()}")


class FreedBlockReuseError(RuntimeError):
    """A block went back to the caching allocator while another stream could still use it, and the
    allocator handed it out again (what `Tensor.record_stream` exists to prevent)."""

    def __init__(self, data_ptr: int, allocation: Access, pending: Access, allocated_on: Stream):
        self.data_ptr, self.allocation, self.pending = data_ptr, allocation, pending
        self.streams = (allocation.stream, pending.stream)
        super().__init__(
            f"SUPA stream sanitizer: data race between streams through the caching allocator: the block "
            f"at {data_ptr:#x} was freed while {stream_name(pending.stream)} could still use it, and "
            f"has been handed out again on {stream_name(allocation.stream)}\n"
            f"  new owner: {allocation.describe()}\n"
            f"  still pending on the other stream: {pending.describe()}\n"
            f"The block belonged to {stream_name(allocated_on)}; call tensor.record_stream(stream) for "
            f"the other stream before freeing it, or order that stream's work before the free.\n"
            f"Stack of the new allocation:\n{allocation.formatted_stack()}"
            f"Stack of the pending access:\n{pending.formatted_stack()}")


@dataclasses.dataclass
class StorageState:
    owner: object  # weak reference to the storage (identity survives while we hold it)
    cdata: int
    allocated_on: Optional[Stream]  # the stream the caching allocator associates the block with
    write: Optional[Access] = None
    reads: Dict[Stream, Access] = dataclasses.field(default_factory=dict)
    recorded_streams: set = dataclasses.field(default_factory=set)  # from record_stream


class HappensBefore:
    """Vector clocks of streams, events and the host."""

    def __init__(self) -> None:
        self._seq: Dict[Stream, int] = {}
        self._known: Dict[Stream, Dict[Stream, int]] = {}
        self._events: Dict[int, Dict[Stream, int]] = {}
        self._host: Dict[Stream, int] = {}
        self._host_version = 0
        self._merged_host_version: Dict[Stream, int] = {}

    def _clock(self, stream: Stream) -> Dict[Stream, int]:
        if stream == HOST:
            return self._host  # what the host has waited for
        known = self._known.get(stream)
        if known is None:
            known = self._known[stream] = {}
        if self._merged_host_version.get(stream) != self._host_version:
            # Work the host queues now comes after everything the host has waited for.
            _merge(known, self._host)
            self._merged_host_version[stream] = self._host_version
        return known

    def next_kernel(self, stream: Stream) -> int:
        known = self._clock(stream)
        if stream != HOST and HOST in self._seq:
            known[HOST] = self._seq[HOST]  # queued by the host after all it has done so far
        seq = self._seq.get(stream, 0) + 1
        self._seq[stream] = seq
        return seq

    def kernels_per_stream(self) -> Dict[Stream, int]:
        return dict(self._seq)

    def is_ordered_before(self, earlier: Access, stream: Stream) -> bool:
        """True when `earlier` completes before the next kernel queued on `stream` starts."""
        if earlier.stream == stream:
            return True
        return self._clock(stream).get(earlier.stream, 0) >= earlier.seq

    def snapshot(self, stream: Stream) -> Dict[Stream, int]:
        clock = dict(self._clock(stream))
        clock[stream] = self._seq.get(stream, 0)
        return clock

    def wait_for(self, stream: Stream, clock: Dict[Stream, int]) -> None:
        _merge(self._clock(stream), clock)

    def record_event(self, event: int, stream: Stream) -> None:
        self._events[event] = self.snapshot(stream)

    def wait_event(self, event: int, stream: Stream) -> None:
        # Waiting on an event never recorded waits for nothing (as on CUDA).
        clock = self._events.get(event)
        if clock is not None:
            self.wait_for(stream, clock)

    def host_waits_for(self, clock: Dict[Stream, int]) -> None:
        _merge(self._host, clock)
        self._host_version += 1

    def synchronize_stream(self, stream: Stream) -> None:
        self.host_waits_for({stream: self._seq.get(stream, 0)})

    def synchronize_event(self, event: int) -> None:
        clock = self._events.get(event)
        if clock is not None:
            self.host_waits_for(clock)

    def synchronize_all(self) -> None:
        self.host_waits_for({s: n for s, n in self._seq.items() if s != HOST})


def _merge(into: Dict[Stream, int], clock: Dict[Stream, int]) -> None:
    for stream, seq in clock.items():
        if into.get(stream, 0) < seq:
            into[stream] = seq


_PRUNE_EVERY = 4096  # new storages between sweeps of the freed ones


class AccessHistory:
    """What each tracked storage saw last, and the checks of a new access against it."""

    def __init__(self, order: HappensBefore, report: Callable[[RuntimeError], None]) -> None:
        self.order = order
        self.report = report
        self.storages: Dict[int, StorageState] = {}
        self._since_prune = 0

    def state_of(self, data_ptr: int, storage, stream: Stream, make_weakref) -> StorageState:
        """The state of `storage`, starting a new one (a new allocation) when the block at
        `data_ptr` belonged to another storage before."""
        cdata = storage._cdata
        state = self.storages.get(data_ptr)
        if state is not None and state.cdata == cdata and not state.owner.expired():
            return state
        # A storage the sanitizer has not seen: allocated outside an operator (storage resize,
        # from_blob, before the sanitizer started). Treat its first access as its allocation.
        return self.allocated(data_ptr, storage, stream, make_weakref, None)

    def allocated(self, data_ptr: int, storage, stream: Stream, make_weakref,
                  allocation: Optional[Access]) -> StorageState:
        """A fresh storage at `data_ptr` on `stream`: checks the block's previous life, then resets."""
        previous = self.storages.get(data_ptr)
        if previous is not None and previous.cdata == storage._cdata and not previous.owner.expired():
            return previous  # the same live storage: not a new allocation after all
        if previous is not None and allocation is not None and previous.allocated_on == stream:
            # The caching allocator hands a freed block only to requests on the stream it was
            # allocated on; it waits only for the streams named by record_stream.
            for pending in _accesses(previous):
                if (pending.stream != stream and pending.stream not in previous.recorded_streams
                        and not self.order.is_ordered_before(pending, stream)):
                    self.report(FreedBlockReuseError(data_ptr, allocation, pending, previous.allocated_on))
                    break
        state = StorageState(make_weakref(storage), storage._cdata, stream)
        self.storages[data_ptr] = state
        self._since_prune += 1
        if self._since_prune >= _PRUNE_EVERY:
            self.prune()
        return state

    def prune(self) -> None:
        """Forget freed storages whose block can no longer be handed out unsafely: every access
        is ordered before the stream that owns the block (clocks only grow, so this stays true)."""
        self._since_prune = 0
        for data_ptr, state in list(self.storages.items()):
            if state.owner.expired() and all(
                    access.stream in state.recorded_streams
                    or self.order.is_ordered_before(access, state.allocated_on)
                    for access in _accesses(state)):
                del self.storages[data_ptr]

    def access(self, data_ptr: int, state: StorageState, access: Access) -> None:
        order = self.order
        stream = access.stream
        write = state.write
        if write is not None and write.stream != stream and not order.is_ordered_before(write, stream):
            self.report(StreamRaceError(data_ptr, access, write))
        if access.is_write:
            for read in state.reads.values():
                if read.stream != stream and not order.is_ordered_before(read, stream):
                    self.report(StreamRaceError(data_ptr, access, read))
                    break
            state.write = access
            state.reads = {}
        else:
            state.reads[stream] = access


def _accesses(state: StorageState) -> List[Access]:
    found = list(state.reads.values())
    if state.write is not None:
        found.append(state.write)
    return found
