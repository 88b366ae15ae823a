"""Stream-race sanitizer for emulated SUPA cards (`torch.supa._sanitizer`), the counterpart of
`torch.cuda._sanitizer`: reports the unsynchronised cross-stream accesses that a real card would
run concurrently while the emulator, executing everything in order, hides them.

Enable it with `SUPA_EMU_SANITIZE=streams` (or `streams-report` to log instead of raising) or by
calling `enable_supa_sanitizer()`. While on, a TorchDispatchMode sees every operator: the op's
schema says which tensor arguments it writes (`Tensor(a!)`) and which it reads, which results are
fresh allocations, and `torch.supa`'s trace callbacks (`_gpu_trace`) give the ordering between
streams (events, waits, synchronisation). Collectives on `bccl` report through
`collective_issued` / `work_waited`. When it is off nothing of this module is imported.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

if __name__ != "supa_emu.supa._sanitizer":
    # Imported as `torch.supa._sanitizer` (the package's path finds this file again): hand out
    # the one module whose state the hooks in torch.supa and bccl report to.
    sys.modules[__name__] = importlib.import_module("supa_emu.supa._sanitizer")

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._traceback import CapturedTraceback

from . import _gpu_trace, _sanitizer_switch, _stream_races
from ._op_effects import COPIES, OpSpec, split_tensors
from ._stream_races import (
    HOST, Access, AccessHistory, FreedBlockReuseError, HappensBefore, StreamRaceError)

__all__ = ["enable_supa_sanitizer", "disable_supa_sanitizer", "SupaSanitizer", "StreamRaceError",
           "FreedBlockReuseError", "supa_sanitizer"]

log = logging.getLogger("supa_emu.sanitizer")


def _current_stream(device_index: int) -> int:
    return torch._C._accelerator_getStream(device_index).stream_id


class _Dispatch(TorchDispatchMode):
    def __init__(self, sanitizer: "SupaSanitizer") -> None:
        super().__init__()
        self.sanitizer = sanitizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return self.sanitizer._run(func, args, kwargs)


class SupaSanitizer:
    """The sanitizer's state: ordering between streams and the access history of storages."""

    def __init__(self) -> None:
        self.enabled = False
        self.report_only = False
        self.reports: List[RuntimeError] = []  # what report-only mode has logged
        self._specs: Dict[Any, OpSpec] = {}
        self._lock = threading.RLock()
        self._dispatch: Optional[_Dispatch] = None
        self._callbacks: List[Tuple[Any, Any]] = []
        self._capturing: Optional[list] = None  # accesses of the graph being captured
        self._reset()

    def _reset(self) -> None:
        self.order = HappensBefore()
        self.history = AccessHistory(self.order, self._report)
        self.host_history = AccessHistory(self.order, self._report)  # pinned host memory

    # ---- switching -----------------------------------------------------------------------------
    def enable(self, report_only: bool = False) -> None:
        """Start tracking (from a clean history). Enter in the thread that runs the model;
        autograd's worker threads inherit the mode."""
        self.report_only = report_only
        if self.enabled:
            return
        self._reset()
        self.reports = []
        for registry, callback in (
                (_gpu_trace.EventRecordCallbacks, self._event_record),
                (_gpu_trace.EventWaitCallbacks, self._event_wait),
                (_gpu_trace.StreamSynchronizationCallbacks, self._stream_synchronize),
                (_gpu_trace.EventSynchronizationCallbacks, self._event_synchronize),
                (_gpu_trace.DeviceSynchronizationCallbacks, self._device_synchronize)):
            registry.add_callback(callback)
            self._callbacks.append((registry, callback))
        # Orderings made in C++ (autograd's cross-stream waits, torch.Event/torch.Stream) reach
        # the same callbacks once PyTorch's GPU trace is on (it stays on for the process).
        _gpu_trace.activate_native_reports()
        self._dispatch = _Dispatch(self)
        _sanitizer_switch.start(self, self._dispatch)
        self.enabled = True

    def summary(self) -> str:
        """One line: how much was checked and how many races were reported (report-only mode)."""
        kernels = self.order.kernels_per_stream()
        streams = ", ".join(f"{_stream_races.stream_name(s)}: {n}" for s, n in kernels.items())
        return (f"SUPA stream sanitizer: {sum(kernels.values())} kernels checked on {len(kernels)} streams "
                f"({streams}); {len(self.reports)} races reported")

    def disable(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        _sanitizer_switch.stop(self, self._dispatch)
        self._dispatch = None
        for registry, callback in self._callbacks:
            registry.callback_list.remove(callback)
        self._callbacks = []

    def _report(self, error: RuntimeError) -> None:
        if self.report_only:
            self.reports.append(error)
            log.error("%s", error)
        else:
            raise error

    # ---- ordering from torch.supa (trace callbacks) ----------------------------------------------
    def _event_record(self, event: int, stream: int) -> None:
        with self._lock:
            self.order.record_event(event, stream)

    def _event_wait(self, event: int, stream: int) -> None:
        with self._lock:
            self.order.wait_event(event, stream)

    def _stream_synchronize(self, stream: int) -> None:
        with self._lock:
            self.order.synchronize_stream(stream)

    def _event_synchronize(self, event: int) -> None:
        with self._lock:
            self.order.synchronize_event(event)

    def _device_synchronize(self) -> None:
        with self._lock:
            self.order.synchronize_all()

    # ---- operators -----------------------------------------------------------------------------
    def _spec(self, func) -> OpSpec:
        spec = self._specs.get(func)
        if spec is None:
            spec = self._specs[func] = OpSpec(func)
        return spec

    def _run(self, func, args, kwargs):
        spec = self._spec(func)
        if spec.metadata_only:
            if spec.name == "aten::record_stream":
                self._record_stream(args[0], args[1] if len(args) > 1 else kwargs["s"])
            return func(*args, **kwargs)
        # Host tensors matter only to copies and while some pinned memory is tracked.
        host = [] if spec.name in COPIES or self.host_history.storages else None
        touched: List[Tuple[torch.Tensor, str, bool]] = []
        for index, name, is_write in spec.arguments:
            value = args[index] if 0 <= index < len(args) else kwargs.get(name)
            if value is None:
                continue
            found: list = []
            known = len(host) if host is not None else 0
            split_tensors(value, found, host)
            for tensor in found:
                touched.append((tensor, name, is_write))
            if host:
                host[known:] = [(t, name, is_write) for t in host[known:]]
        result = func(*args, **kwargs)
        fresh: list = []
        if spec.fresh_returns:
            known = len(host) if host is not None else 0
            if len(spec.fresh_returns) == 1 and not isinstance(result, tuple):
                split_tensors(result, fresh, host)
            else:
                for i in spec.fresh_returns:
                    split_tensors(result[i], fresh, host)
            if host:
                host[known:] = [(t, "result", True) for t in host[known:]]
        if host:
            self._host_side(spec.name, touched, fresh, host)
        if not touched and not fresh:
            return result
        device = (touched[0][0] if touched else fresh[0]).get_device()
        stack = CapturedTraceback.extract()
        with self._lock:
            stream = _current_stream(device)
            seq = self.order.next_kernel(stream)
            if self._capturing is not None:
                # On a card, capture only records kernels; they touch memory when replayed.
                # Addresses, not tensors: holding the tensors would keep capture temporaries
                # from going back to the graph's pool (replays run on the same addresses).
                self._capturing.extend(_captured(t, w, spec.name, n) for t, n, w in touched)
                self._capturing.extend(_captured(t, True, spec.name, "result") for t in fresh)
                for tensor in fresh:
                    self._allocated(tensor, stream, seq, spec.name, stack, access=False)
                return result
            for tensor, name, is_write in touched:
                self._access(tensor, stream, seq, is_write, spec.name, name, stack)
            for tensor in fresh:
                self._allocated(tensor, stream, seq, spec.name, stack)
            if spec.synchronising or self._synchronous_host_copy(spec.name, args, kwargs):
                self.order.synchronize_stream(stream)
        return result

    def _host_side(self, op: str, touched, fresh, host) -> None:
        """Pinned host memory: a copy uses it on the device's current stream (asynchronously when
        non_blocking), and CPU code uses it on the host, which is ordered after the stream only
        once it has synchronised with it."""
        device_side = touched[0][0] if touched else fresh[0] if fresh else None
        if device_side is None or op not in COPIES:
            storages = self.host_history.storages
            host = [entry for entry in host if entry[0].untyped_storage().data_ptr() in storages]
            if not host:
                return
        stack = CapturedTraceback.extract()
        if device_side is not None and op in COPIES:
            # is_pinned() is an operator: it releases the GIL, so it is asked outside the lock.
            pinned = [entry for entry in host if entry[0].is_pinned()]
            with self._lock:
                stream = _current_stream(device_side.get_device())
                seq = self.order.next_kernel(stream)  # the copy itself (a kernel of its own)
                for tensor, name, is_write in pinned:
                    self._host_access(tensor, stream, seq, is_write, op, name, stack, track=True)
            return
        with self._lock:
            seq = self.order.next_kernel(HOST)
            for tensor, name, is_write in host:
                self._host_access(tensor, HOST, seq, is_write, op, name, stack, track=False)

    def _host_access(self, tensor, stream, seq, is_write, op, name, stack, track: bool) -> None:
        storage = tensor.untyped_storage()
        data_ptr = storage.data_ptr()
        history = self.host_history
        state = history.storages.get(data_ptr)
        if state is None or state.cdata != storage._cdata or state.owner.expired():
            if not track:  # host memory no copy has used (or its previous owner's): not tracked
                history.storages.pop(data_ptr, None)
                return
            state = history.allocated(data_ptr, storage, stream, StorageWeakRef, None)
        access = Access(stream, seq, is_write, op, (name, tuple(tensor.shape), tensor.dtype, -1), stack)
        history.access(data_ptr, state, access)

    @staticmethod
    def _synchronous_host_copy(name: str, args, kwargs) -> bool:
        """A blocking copy between host and card: the host waits for the stream (as cudaMemcpy)."""
        if name == "aten::copy_":
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            return blocking and (args[0].is_cpu or args[1].is_cpu)
        if name == "aten::_to_copy":
            target = kwargs.get("device")
            blocking = not kwargs.get("non_blocking", False)
            return blocking and target is not None and torch.device(target).type == "cpu"
        return False

    def _access(self, tensor, stream, seq, is_write, op, name, stack) -> None:
        storage = tensor.untyped_storage()
        data_ptr = storage.data_ptr()
        if data_ptr == 0:
            return
        state = self.history.state_of(data_ptr, storage, stream, StorageWeakRef)
        access = Access(stream, seq, is_write, op, _describe(name, tensor), stack)
        self.history.access(data_ptr, state, access)

    def _allocated(self, tensor, stream, seq, op, stack, access: bool = True) -> None:
        storage = tensor.untyped_storage()
        data_ptr = storage.data_ptr()
        if data_ptr == 0:
            return
        write = Access(stream, seq, True, op, _describe("result", tensor), stack)
        state = self.history.allocated(data_ptr, storage, stream, StorageWeakRef, write if access else None)
        if access:
            self.history.access(data_ptr, state, write)

    def _record_stream(self, tensor, stream) -> None:
        if tensor.is_cpu or tensor.get_device() < 0:
            return
        storage = tensor.untyped_storage()
        data_ptr = storage.data_ptr()
        if data_ptr == 0:
            return
        with self._lock:
            state = self.history.state_of(data_ptr, storage, _current_stream(tensor.get_device()), StorageWeakRef)
            state.recorded_streams.add(stream.stream_id)

    # ---- graphs (called by torch.supa.graphs while the sanitizer is on) ----------------------------
    def graph_capture_begin(self, graph) -> None:
        self._capturing = []

    def graph_capture_end(self, graph) -> None:
        graph._supa_sanitizer_accesses, self._capturing = self._capturing or [], None

    def graph_replayed(self, graph) -> None:
        """A replay runs the captured kernels again, as one unit of work on the current stream."""
        accesses = getattr(graph, "_supa_sanitizer_accesses", None)
        if not accesses:
            return
        stack = CapturedTraceback.extract()
        with self._lock:
            stream = _current_stream(accesses[0][1][3])
            seq = self.order.next_kernel(stream)
            for data_ptr, tensor, is_write, op in accesses:
                # Whatever storage holds the captured address now is what the replay touches; an
                # address no storage was ever seen at has no history to conflict with.
                state = self.history.storages.get(data_ptr)
                if state is not None:
                    access = Access(stream, seq, is_write, f"graph replay of {op}", tensor, stack)
                    self.history.access(data_ptr, state, access)

    # ---- collectives (called by supa_emu.distributed while the sanitizer is on) ------------------
    def collective_issued(self, work, group: str, accesses, op: str) -> None:
        """A bccl collective over `accesses` [(tensor, read, write)] was queued: it runs on the
        group's communication stream, after the work queued so far on the current stream."""
        tensors = [(t, r, w) for t, r, w in accesses if not t.is_cpu and t.get_device() >= 0]
        if not tensors:
            return
        device = tensors[0][0].get_device()
        stack = CapturedTraceback.extract()
        with self._lock:
            current = _current_stream(device)
            comm = ("bccl", group, device)
            self.order.wait_for(comm, self.order.snapshot(current))
            seq = self.order.next_kernel(comm)
            for tensor, read, write in tensors:
                self._access(tensor, comm, seq, write, f"bccl {op}", "collective buffer", stack)
                # The group keeps its buffers from the allocator until the collective is done, as
                # NCCL's process group does (record_stream on its stream, or tensors held by the
                # work): a buffer freed early is not handed out again while the collective runs.
                storage = tensor.untyped_storage()
                if storage.data_ptr() != 0:
                    self.history.state_of(storage.data_ptr(), storage, current,
                                          StorageWeakRef).recorded_streams.add(comm)
            work._supa_sanitizer_clock = (device, self.order.snapshot(comm))

    def written_outside_operators(self, tensors) -> None:
        # torch.supa.bccl's single-process collectives: synchronous host copies issued on no
        # stream, which this sanitizer does not model (docs/collectives.md, "torch.supa.bccl").
        pass

    def work_waited(self, work) -> None:
        """`Work.wait()`: later work on the current stream comes after the collective."""
        issued = getattr(work, "_supa_sanitizer_clock", None)
        if issued is None:
            return
        device, clock = issued
        with self._lock:
            self.order.wait_for(_current_stream(device), clock)


def _captured(tensor: torch.Tensor, is_write: bool, op: str, name: str) -> tuple:
    return (tensor.untyped_storage().data_ptr(), _describe(name, tensor), is_write, op)


def _describe(name: str, tensor: torch.Tensor) -> tuple:
    # Formatted only when a report is made (see Access.describe).
    return (name, tuple(tensor.shape), tensor.dtype, tensor.get_device())


supa_sanitizer = SupaSanitizer()


def enable_supa_sanitizer(report_only: bool = False) -> None:
    """Turn the stream sanitizer on for this process (as `torch.cuda._sanitizer.enable_cuda_sanitizer`).

    From now on an operator that touches supa memory whose last conflicting access on another
    stream is not ordered before it raises `StreamRaceError` (with `report_only`, the error is
    logged and kept in `supa_sanitizer.reports` instead), and a block freed while another stream
    could still use it and handed out again raises `FreedBlockReuseError`.
    """
    supa_sanitizer.enable(report_only=report_only)
    if report_only:
        atexit.register(_log_summary)


def _log_summary() -> None:
    if supa_sanitizer.enabled and supa_sanitizer.order.kernels_per_stream():
        log.warning("%s", supa_sanitizer.summary())


def disable_supa_sanitizer() -> None:
    """Stop tracking; the history is dropped."""
    supa_sanitizer.disable()

