"""Random-number state of SUPA devices: one `torch.Generator` per device.

Each is a counter-based Philox generator whose state is CUDA's: 16 bytes, the seed (uint64) and
the counter offset (int64, a multiple of 4).

Seeding before the runtime is initialised is deferred (queued with `_lazy_call`) so that
`torch.manual_seed(...)` at the top of a script works without touching the device.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch

from supa_emu import process_state
from supa_emu.device_type import DEVICE_TYPE

from ._runtime import _get_device_index, _lazy_call, _lazy_init, current_device, device_count

__all__ = [
    "get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "initial_seed",
]

_DeviceLike = Union[int, str, torch.device]


def _generators() -> tuple[torch.Generator, ...]:
    return process_state.default_generators()


def get_rng_state(device: _DeviceLike = DEVICE_TYPE) -> torch.Tensor:
    """The RNG state of `device` (default: current) as a uint8 CPU tensor of 16 bytes, (seed, offset).
    Initialises the runtime."""
    _lazy_init()
    return _generators()[_get_device_index(device, optional=True)].get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    """The RNG states of all devices, indexed by device."""
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state(new_state: torch.Tensor, device: _DeviceLike = DEVICE_TYPE) -> None:
    """Restore `device`'s RNG state from `get_rng_state` output (deferred until initialisation).

    When applied, a state that is not a uint8 CPU tensor raises TypeError, one of another
    size than 16 (or 8: a seed alone) RuntimeError("RNG state is wrong size"), as CUDA's generator does.
    """
    state = new_state.clone(memory_format=torch.contiguous_format)

    def apply() -> None:
        _generators()[_get_device_index(device, optional=True)].set_state(state)

    _lazy_call(apply)


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    """Restore every device's RNG state; `new_states[i]` goes to device i."""
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator (deferred until initialisation; then only the
    latest such call runs, after the other deferred calls)."""
    seed = int(seed)

    def apply() -> None:
        _generators()[current_device()].manual_seed(seed)

    _lazy_call(apply, seed=True)


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (deferred until initialisation; then only the latest such
    call runs, after the other deferred calls). `torch.manual_seed` calls this."""
    seed = int(seed)

    def apply() -> None:
        for gen in _generators():
            gen.manual_seed(seed)

    _lazy_call(apply, seed_all=True)


def seed() -> None:
    """Seed the current device's generator with a fresh random number (deferred)."""

    def apply() -> None:
        _generators()[current_device()].seed()

    _lazy_call(apply)


def seed_all() -> None:
    """Seed device 0 with a fresh random number and every other device with the same value (deferred)."""

    def apply() -> None:
        gens = _generators()
        if not gens:
            return
        value = gens[0].seed()
        for gen in gens[1:]:
            gen.manual_seed(value)

    _lazy_call(apply)


def initial_seed() -> int:
    """The seed the current device's generator was last seeded with. Initialises the runtime."""
    _lazy_init()
    return _generators()[current_device()].initial_seed()
