"""The emulated card: the properties `torch.supa.get_device_properties()` reports.

The numbers describe a Biren BR104-class card closely enough for code that sizes work by
them (memory, SM count, warp size). They are not measured on hardware; they only need to be
plausible and stable so that tests and tooling see the same card everywhere.
"""

from __future__ import annotations

import dataclasses
import uuid as _uuid

GiB = 1 << 30
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Static properties of one emulated SUPA card (field names of `_SupaDeviceProperties`), then
    the sizes its libraries keep."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_multi_gpu_board: bool = False
    is_integrated: bool = False
    max_threads_per_multi_processor: int = 2048
    max_threads_per_block: int = 1024
    warp_size: int = 32
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_block_optin: int = 128 * 1024
    shared_memory_per_multiprocessor: int = 256 * 1024
    regs_per_multiprocessor: int = 65536
    clock_rate: int = 1_500_000  # kHz
    memory_clock_rate: int = 1_600_000  # kHz
    memory_bus_width: int = 4096
    L2_cache_size: int = 8 * MiB
    # The BLAS library's workspaces, one per (thread's handle, stream) once it has run a matrix
    # product, and the extra one of its bias-epilogue (Lt) path. Biren publishes no Sublas figure;
    # these are what cuBLAS keeps on an H200 (tests/data/fidelity/h200_kernels.json), the card the
    # emulator's memory is held to. SUPA_EMU_SUBLAS_WORKSPACE_CONFIG overrides the first.
    blas_workspace_size: int = 32 * MiB
    blaslt_workspace_size: int = 1 * MiB

    def uuid_bytes(self, physical_index: int) -> bytes:
        """A stable 16-byte UUID per (profile, physical card index)."""
        return _uuid.uuid5(_uuid.NAMESPACE_DNS, f"supa-emu/{self.name}/{physical_index}").bytes


PROFILES = {
    "BR104": DeviceProfile(name="BR104", total_memory=32 * GiB, major=1, minor=4, multi_processor_count=32),
    "BR100": DeviceProfile(name="BR100", total_memory=64 * GiB, major=1, minor=0, multi_processor_count=64),
}
DEFAULT_PROFILE = "BR104"
