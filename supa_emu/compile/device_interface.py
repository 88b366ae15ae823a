"""`SupaInterface`: what Dynamo and Inductor ask a device runtime (current device, streams,
synchronize, properties), answered by `torch.supa`, as torch_supa's interface of the same name.

Imported only once `torch._dynamo.device_interface` exists (see `supa_emu.compile`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.device_interface import (
    DeviceInterface, caching_worker_current_devices, caching_worker_device_properties)

from supa_emu.device_type import DEVICE_TYPE


def _index_of(device: Any) -> int:
    """The card index `device` names (None: the current card), refusing other device types."""
    if device is None:
        return torch.supa.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != DEVICE_TYPE:
            raise ValueError(f"expected a '{DEVICE_TYPE}' device, got '{device}'")
        return torch.supa.current_device() if device.index is None else device.index
    return int(device)


class SupaInterface(DeviceInterface):
    device = torch.supa.device  # type: ignore[assignment]
    Event = torch.supa.Event  # type: ignore[assignment]
    Stream = torch.supa.Stream  # type: ignore[assignment]

    class Worker:
        """Answers for compile workers, from values recorded in the parent process."""

        @staticmethod
        def set_device(device: int) -> None:
            caching_worker_current_devices[DEVICE_TYPE] = device

        @staticmethod
        def current_device() -> int:
            if DEVICE_TYPE in caching_worker_current_devices:
                return caching_worker_current_devices[DEVICE_TYPE]
            return torch.supa.current_device()

        @staticmethod
        def get_device_properties(device: Any = None) -> Any:
            index = SupaInterface.Worker.current_device() if device is None else _index_of(device)
            if DEVICE_TYPE not in caching_worker_device_properties:
                caching_worker_device_properties[DEVICE_TYPE] = [
                    torch.supa.get_device_properties(i) for i in range(torch.supa.device_count())]
            return caching_worker_device_properties[DEVICE_TYPE][index]

    current_device = staticmethod(torch.supa.current_device)
    set_device = staticmethod(torch.supa.set_device)
    device_count = staticmethod(torch.supa.device_count)
    stream = staticmethod(torch.supa.stream)  # type: ignore[assignment]
    current_stream = staticmethod(torch.supa.current_stream)
    set_stream = staticmethod(torch.supa.set_stream)  # type: ignore[assignment]
    _set_stream_by_id = staticmethod(torch.supa.set_stream_by_id)  # type: ignore[assignment]
    synchronize = staticmethod(torch.supa.synchronize)
    get_device_properties = staticmethod(torch.supa.get_device_properties)  # type: ignore[assignment]
    exchange_device = staticmethod(torch.supa._exchange_device)
    maybe_exchange_device = staticmethod(torch.supa._maybe_exchange_device)
    memory_allocated = staticmethod(torch.supa.memory_allocated)

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return torch.supa.current_stream(device_idx).supa_stream

    @staticmethod
    def is_available() -> bool:
        return torch.supa.device_count() > 0

    @staticmethod
    def get_compute_capability(device: Any = None) -> int:
        major, minor = torch.supa.get_device_capability(device)
        return major * 10 + minor

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True
