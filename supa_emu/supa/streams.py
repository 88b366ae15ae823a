"""SUPA streams and events, and the functions that select the current stream.

`Stream` and `Event` extend PyTorch's generic `torch.Stream` / `torch.Event`, which the native
core backs for the supa device: stream ids (with their priority), event records and timestamps,
and the time until which a stream is busy (`_sleep`), live in the core, not here. Work executes
synchronously on the host, so ordering between streams always holds; the objects still keep the
identities, busy times and timing users rely on.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any, Optional

import torch

from supa_emu.device_type import DEVICE_TYPE

from . import _gpu_trace
from ._runtime import _get_device_index, _lazy_init, _native
from ._runtime import device as _device_ctx

__all__ = [
    "Stream", "ExternalStream", "Event", "StreamContext", "stream", "current_stream",
    "default_stream", "set_stream",
]

_IPC_HANDLE_SIZE = 64
_IPC_MAGIC = b"SUPAEMUEVT"


# The integer DeviceType codes torch.Stream carries: supa's (PrivateUse1) and CUDA's, which code
# written for CUDA passes literally and which means supa under transfer_to_supa.
_SUPA_DEVICE_TYPE = int(torch._C._autograd.DeviceType.PrivateUse1)
_CUDA_DEVICE_TYPE = int(torch._C._autograd.DeviceType.CUDA)


def _rebuilt_stream_fields(kwargs: dict) -> tuple[int, int, int]:
    """(stream_id, device_index, device_type) of a stream named by its fields: a missing device
    index is the current device; the device type must be supa's (or CUDA's, under the transfer)."""
    device_type = int(kwargs.get("device_type", _SUPA_DEVICE_TYPE))
    if device_type == _CUDA_DEVICE_TYPE and _native()._cuda_means_supa():
        device_type = _SUPA_DEVICE_TYPE
    if device_type != _SUPA_DEVICE_TYPE:
        raise RuntimeError(f"Expected a supa stream (device_type {_SUPA_DEVICE_TYPE}), but got device_type "
                           f"{device_type}")
    device_index = kwargs.get("device_index")
    idx = _get_device_index(None if device_index is None else int(device_index), optional=True)
    _native()._check_device_index(idx)
    return int(kwargs.get("stream_id", 0)), idx, device_type


class Stream(torch.Stream):
    """A SUPA stream: an in-order queue of work on one device.

    `Stream(device=None, priority=0)` takes a new stream from the device's pool (default:
    current device); `Stream(stream_id=..., device_index=..., device_type=...)` rebuilds the stream
    those fields of another one name (`device_type` supa's, or CUDA's under transfer_to_supa).
    `supa_stream` is its integer handle; the default stream's is 0.
    """

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if "stream_ptr" in kwargs:
            if priority != 0:
                raise RuntimeError("Priority was explicitly set for a external stream")
            idx = _get_device_index(device, optional=True)
            kwargs = {"stream_id": int(kwargs.pop("stream_ptr")), "device_index": idx,
                      "device_type": _SUPA_DEVICE_TYPE, **kwargs}
        unknown = sorted(set(kwargs) - {"stream_id", "device_index", "device_type"})
        if unknown:
            raise TypeError(f"Stream() got unexpected keyword arguments {unknown}")
        if kwargs:
            _lazy_init()
            stream_id, device_index, device_type = _rebuilt_stream_fields(kwargs)
            return super().__new__(cls, stream_id=stream_id, device_index=device_index, device_type=device_type)
        _lazy_init()
        idx = _get_device_index(device, optional=True)
        with _device_ctx(idx):
            self = super().__new__(cls, device=torch.device(DEVICE_TYPE, idx), priority=priority)
        _gpu_trace.StreamCreationCallbacks.fire_callbacks(self.supa_stream)
        return self

    @property
    def supa_stream(self) -> int:
        """The stream's raw handle (0 for the default stream)."""
        return int(self.stream_id)

    @property
    def priority(self) -> int:
        """Scheduling priority given at creation (0 is the default, lower is more urgent)."""
        return int(_native()._stream_priority(self.stream_id))

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest) priority values accepted by `Stream(priority=...)`."""
        return 0, -1

    def wait_event(self, event: "Event") -> None:
        """Make later work on this stream wait for `event`."""
        event.wait(self)

    def wait_stream(self, stream: "Stream") -> None:
        """Make later work on this stream wait for all work queued so far on `stream`."""
        self.wait_event(stream.record_event())

    def record_event(self, event: Optional["Event"] = None) -> "Event":
        """Record `event` (a new one if None) on this stream and return it."""
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """True when all queued work has completed: kernels finish before their call returns, so
        False only while time queued by `_sleep` (here or on a stream waited for) runs."""
        return super().query()

    def synchronize(self) -> None:
        """Block until all queued work on this stream has completed."""
        super().synchronize()
        if not _gpu_trace.native_reports:
            _gpu_trace.StreamSynchronizationCallbacks.fire_callbacks(self.supa_stream)

    @property
    def _as_parameter_(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.supa_stream)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, torch.Stream):
            return False
        return (self.stream_id, self.device_index, self.device_type) == (
            other.stream_id, other.device_index, other.device_type)

    def __hash__(self) -> int:
        return hash((self.supa_stream, self.device))

    def __repr__(self) -> str:
        return f"<torch_supa.supa.Stream device={self.device} supa_stream={self.supa_stream:#x}>"


class ExternalStream(Stream):
    """A stream created elsewhere and identified by its raw handle (`supa_stream` of another
    Stream in the emulator). The handle is not owned: nothing is released when this goes away."""

    def __new__(cls, stream_ptr: int, device: Any = None, **kwargs: Any) -> "ExternalStream":
        return super().__new__(cls, device, stream_ptr=stream_ptr, **kwargs)


class Event(torch.Event):
    """A SUPA event: a marker in a stream used for synchronisation and timing.

    `enable_timing` allows `elapsed_time`; `blocking` changes nothing (the host waits by
    sleeping either way); `interprocess` allows `ipc_handle`, whose handles work within this
    machine's emulator only. `external` is CUDA's flag for a record or wait that becomes a node of
    a graph being captured; it is accepted and changes nothing here: the emulator's graphs replay
    kernels and hold no event nodes of any kind. The event is created lazily on its first
    `record`.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,
                interprocess: bool = False, external: bool = False) -> "Event":
        self = super().__new__(cls, device=torch.device(DEVICE_TYPE), enable_timing=enable_timing,
                               blocking=blocking, interprocess=interprocess)
        # The only flag the core does not keep: torch.Event has no interprocess events.
        self._interprocess = bool(interprocess)
        return self

    @classmethod
    def from_ipc_handle(cls, device: Any, handle: bytes) -> "Event":
        """Reopen an event from `ipc_handle()` bytes. Raises RuntimeError for a bad handle or a
        non-supa device. The reopened event is complete (the exporter's work already ran)."""
        try:
            idx = _get_device_index(device, optional=True)
        except ValueError:
            raise RuntimeError(f"Event can only be created on SUPA devices, but got device type "
                               f"{torch.device(device).type}") from None
        if len(handle) != _IPC_HANDLE_SIZE or not bytes(handle).startswith(_IPC_MAGIC):
            raise RuntimeError(f"Invalid SUPA event IPC handle (expected {_IPC_HANDLE_SIZE} bytes from Event.ipc_handle())")
        event = cls(interprocess=True)
        event.record(default_stream(idx))
        return event

    @property
    def device(self) -> Optional[torch.device]:
        """Device of the stream the event was recorded on; None before the first record."""
        return super().device if self.event_id else None

    @property
    def supa_event(self) -> int:
        """The event's raw handle; 0 until the event is first recorded."""
        return int(self.event_id)

    def record(self, stream: Optional[Stream] = None) -> None:
        """Record the event on `stream` (default: the current stream)."""
        if stream is None:
            stream = current_stream()
        super().record(stream)
        if not _gpu_trace.native_reports:
            _gpu_trace.EventRecordCallbacks.fire_callbacks(self.supa_event, stream.stream_id)

    def wait(self, stream: Optional[Stream] = None) -> None:
        """Make later work on `stream` (default: current) wait for this event."""
        if stream is None:
            stream = current_stream()
        super().wait(stream)
        if not _gpu_trace.native_reports:
            _gpu_trace.EventWaitCallbacks.fire_callbacks(self.supa_event, stream.stream_id)

    def query(self) -> bool:
        """True when the work recorded before this event has completed."""
        return super().query()

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between the times the streams reached this event and `end_event`.

        As CUDA's: ValueError unless both events were created with `enable_timing=True`, then
        unless both were recorded; RuntimeError unless both have completed (`synchronize` first
        after a `_sleep`) or when they belong to two devices.
        """
        # torch.Event.elapsed_time accepts only exact torch.Event arguments, so the core is
        # asked directly; it keeps the time each record's stream reaches it.
        if not isinstance(end_event, Event):
            raise TypeError(f"expected end_event to be a torch.supa.Event, got {type(end_event).__name__}")
        return float(_native()._event_elapsed_time(self, end_event))

    def synchronize(self) -> None:
        """Block until the work recorded before this event has completed."""
        super().synchronize()
        if not _gpu_trace.native_reports:
            _gpu_trace.EventSynchronizationCallbacks.fire_callbacks(self.supa_event)

    def ipc_handle(self) -> bytes:
        """Bytes that identify this event to `Event.from_ipc_handle`. Requires `interprocess=True`
        and a prior `record`; raises RuntimeError otherwise."""
        if not self._interprocess:
            raise RuntimeError("Event.ipc_handle() needs an event created with interprocess=True")
        if not self.event_id:
            raise RuntimeError("Event.ipc_handle() needs a recorded event")
        body = _IPC_MAGIC + struct.pack("<qqq", os.getpid(), self.device.index, self.supa_event)
        return body.ljust(_IPC_HANDLE_SIZE, b"\0")

    @property
    def _as_parameter_(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.supa_event)

    def __repr__(self) -> str:
        if self.supa_event:
            return f"<torch_supa.supa.Event {self.supa_event:#x}>"
        return "<torch_supa.supa.Event uninitialized>"


# ---------------------------------------------------------------------------------------------
# Current-stream selection.

def current_stream(device: Any = None) -> Stream:
    """The stream work is currently queued to on `device` (default: current device)."""
    _lazy_init()
    s = torch.accelerator.current_stream(None if device is None else _get_device_index(device, optional=True))
    # torch.Stream's own constructor: the checks of Stream.__new__ are for user-given handles.
    return torch.Stream.__new__(Stream, stream_id=s.stream_id, device_index=s.device_index,
                                device_type=s.device_type)


def default_stream(device: Any = None) -> Stream:
    """The default (null) stream of `device` (default: current device); its handle is 0."""
    _lazy_init()
    idx = _get_device_index(device, optional=True)
    return Stream(stream_id=0, device_index=idx, device_type=_SUPA_DEVICE_TYPE)


def set_stream(stream: Optional[torch.Stream]) -> None:
    """Make `stream` current (and its device the current device). None is a no-op."""
    if stream is None:
        return
    _lazy_init()
    torch.accelerator.set_stream(stream)


class StreamContext:
    """Selects `stream` on entry and restores the previously current streams on exit.

    A None stream (or no current device) makes the context a no-op. When the stream lives on
    another device, that device's current stream is saved and restored too.
    """

    def __init__(self, stream: Optional[torch.Stream]) -> None:
        self.stream = stream
        self.idx = _get_device_index(None, True)
        self.src_prev_stream: Optional[Stream] = None
        self.dst_prev_stream: Optional[Stream] = None

    def __enter__(self) -> None:
        target = self.stream
        if target is None or self.idx == -1:
            return
        self.src_prev_stream = current_stream(None)
        if self.src_prev_stream.device != target.device:
            with _device_ctx(target.device):
                self.dst_prev_stream = current_stream(target.device)
        set_stream(target)

    def __exit__(self, *exc_info: Any) -> None:
        if self.stream is None or self.idx == -1:
            return
        if self.src_prev_stream is not None and self.src_prev_stream.device != self.stream.device:
            set_stream(self.dst_prev_stream)
        set_stream(self.src_prev_stream)


def stream(stream: Optional[torch.Stream]) -> StreamContext:
    """Context manager selecting `stream` within the block (see StreamContext)."""
    return StreamContext(stream)
