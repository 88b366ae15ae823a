"""Callback registries for SUPA trace events (`torch.supa._gpu_trace`), as torch.cuda has them.

Tools such as stream sanitizers register here. `torch.supa`'s streams, events and `synchronize`
fire the callbacks themselves, until a tool turns PyTorch's GPU trace on (`activate_native_reports`):
from then the native core reports every record, wait and synchronisation, also those made in C++
(autograd, torch.Event), and the Python wrappers stop reporting them a second time.

Event creation and deletion and memory allocation and deallocation happen only in the native
core (the device guard and the caching allocator report them, as CUDA's do), so registering for
one of those turns the trace on; the allocator reports only once a memory callback is registered,
so a trace turned on for the stream sanitizer costs allocations nothing.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._utils import CallbackRegistry

from supa_emu import process_state

# True once PyTorch's GPU trace is on for this process (it cannot be turned off again).
native_reports = False


def activate_native_reports() -> None:
    """Turn PyTorch's GPU trace on: the native core then fires these callbacks itself."""
    global native_reports
    if not native_reports:
        torch._C._activate_gpu_trace()
        native_reports = True


def _report_memory_blocks() -> None:
    activate_native_reports()
    process_state.core()._report_blocks_to_gpu_trace()


EventCreationCallbacks: CallbackRegistry[int] = CallbackRegistry("SUPA event creation")
EventDeletionCallbacks: CallbackRegistry[int] = CallbackRegistry("SUPA event deletion")
EventRecordCallbacks: CallbackRegistry[int, int] = CallbackRegistry("SUPA event record")
EventWaitCallbacks: CallbackRegistry[int, int] = CallbackRegistry("SUPA event wait")
MemoryAllocationCallbacks: CallbackRegistry[int] = CallbackRegistry("SUPA memory allocation")
MemoryDeallocationCallbacks: CallbackRegistry[int] = CallbackRegistry("SUPA memory deallocation")
StreamCreationCallbacks: CallbackRegistry[int] = CallbackRegistry("SUPA stream creation")
DeviceSynchronizationCallbacks: CallbackRegistry[[]] = CallbackRegistry("SUPA device synchronization")
StreamSynchronizationCallbacks: CallbackRegistry[int] = CallbackRegistry("SUPA stream synchronization")
EventSynchronizationCallbacks: CallbackRegistry[int] = CallbackRegistry("SUPA event synchronization")


def register_callback_for_event_creation(cb: Callable[[int], None]) -> None:
    EventCreationCallbacks.add_callback(cb)
    activate_native_reports()


def register_callback_for_event_deletion(cb: Callable[[int], None]) -> None:
    EventDeletionCallbacks.add_callback(cb)
    activate_native_reports()


def register_callback_for_event_record(cb: Callable[[int, int], None]) -> None:
    EventRecordCallbacks.add_callback(cb)


def register_callback_for_event_wait(cb: Callable[[int, int], None]) -> None:
    EventWaitCallbacks.add_callback(cb)


def register_callback_for_memory_allocation(cb: Callable[[int], None]) -> None:
    MemoryAllocationCallbacks.add_callback(cb)
    _report_memory_blocks()


def register_callback_for_memory_deallocation(cb: Callable[[int], None]) -> None:
    MemoryDeallocationCallbacks.add_callback(cb)
    _report_memory_blocks()


def register_callback_for_stream_creation(cb: Callable[[int], None]) -> None:
    StreamCreationCallbacks.add_callback(cb)


def register_callback_for_device_synchronization(cb: Callable[[], None]) -> None:
    DeviceSynchronizationCallbacks.add_callback(cb)


def register_callback_for_stream_synchronization(cb: Callable[[int], None]) -> None:
    StreamSynchronizationCallbacks.add_callback(cb)


def register_callback_for_event_synchronization(cb: Callable[[int], None]) -> None:
    EventSynchronizationCallbacks.add_callback(cb)
