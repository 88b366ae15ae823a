"""The object `torch.supa.get_device_properties()` returns, filled from the emulated card profile.

The profile and the visible-device mapping come from the configuration activation validated;
the memory size from the core, which owns each card's capacity.
"""

from __future__ import annotations

import functools
from typing import Any

from supa_emu import process_state

_MiB = 1 << 20

# Field order of the real `_SupaDeviceProperties`; the object exposes exactly these names.
_FIELDS = (
    "name", "major", "minor", "is_multi_gpu_board", "is_integrated", "multi_processor_count",
    "total_memory", "max_threads_per_multi_processor", "max_threads_per_block", "warp_size",
    "shared_memory_per_block", "clock_rate", "memory_clock_rate", "memory_bus_width",
    "shared_memory_per_block_optin", "shared_memory_per_multiprocessor", "regs_per_multiprocessor",
    "gcnArchName", "uuid", "pci_bus_id", "pci_device_id", "pci_domain_id", "L2_cache_size",
)


class _SUuuid:
    """A device UUID: `.bytes` is a list of 16 ints, `str()` the 36-char 8-4-4-4-12 hex form."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if len(raw) != 16:
            raise ValueError(f"a device UUID has 16 bytes, got {len(raw)}")
        object.__setattr__(self, "_raw", bytes(raw))

    @property
    def bytes(self) -> list[int]:
        return list(self._raw)

    def __str__(self) -> str:
        h = self._raw.hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SUuuid) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash(self._raw)


class _SupaDeviceProperties:
    """Read-only properties of one SUPA device (the fields of the real runtime's struct)."""

    __slots__ = tuple(f"_{f}" for f in _FIELDS)

    def __init__(self, **values: Any) -> None:
        missing = set(_FIELDS) - set(values)
        extra = set(values) - set(_FIELDS)
        if missing or extra:
            raise TypeError(f"device properties need exactly {_FIELDS}; missing {missing}, unexpected {extra}")
        for field in _FIELDS:
            object.__setattr__(self, f"_{field}", values[field])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"'_SupaDeviceProperties' attribute '{name}' is read-only")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) - set(self.__slots__))

    def __repr__(self) -> str:
        return (f"_SupaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // _MiB}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
                f"pci_domain_id={self.pci_domain_id}, L2_cache_size={self.L2_cache_size // _MiB}MB)")


def _make_getter(field: str) -> property:
    slot = f"_{field}"
    return property(lambda self: getattr(self, slot), doc=f"the device's {field}")


for _field in _FIELDS:
    setattr(_SupaDeviceProperties, _field, _make_getter(_field))
del _field


# Built once per index: the profile, the visible devices and the capacities are fixed at
# activation, and every call returns the same object, as torch.cuda's does.
@functools.lru_cache(maxsize=None)
def _device_properties(idx: int) -> _SupaDeviceProperties:
    """Properties of visible device `idx` (caller has range-checked it)."""
    cfg = process_state.config()
    profile = cfg.profile
    physical = cfg.visible_devices[idx] if idx < len(cfg.visible_devices) else idx
    return _SupaDeviceProperties(
        name=profile.name,
        total_memory=int(process_state.core()._capacity(idx)),
        gcnArchName=profile.name,
        uuid=_SUuuid(profile.uuid_bytes(physical)),
        # A plausible PCI topology: one card per bus, identified by its physical slot, so
        # the ids stay stable when SUPA_VISIBLE_DEVICES reorders the cards.
        pci_bus_id=0x10 + physical,
        pci_device_id=0,
        pci_domain_id=0,
        **{field: getattr(profile, field) for field in _FROM_PROFILE},
    )


# Properties the device profile gives as they are.
_FROM_PROFILE = (
    "major", "minor", "is_multi_gpu_board", "is_integrated", "multi_processor_count",
    "max_threads_per_multi_processor", "max_threads_per_block", "warp_size", "shared_memory_per_block",
    "clock_rate", "memory_clock_rate", "memory_bus_width", "shared_memory_per_block_optin",
    "shared_memory_per_multiprocessor", "regs_per_multiprocessor", "L2_cache_size",
)
