"""What a card can do per second: the figures the planner's time model reads (docs/time_on_the_card.md).

device_profile.py holds what the emulated card reports about itself (`get_device_properties`);
this module holds its speeds: peak dense throughput per dtype, memory bandwidth, the host link,
the card-to-card link and the inter-host network, kernel launch latency. Each figure names its
source. Biren's cards are the ones the emulator stands for; NVIDIA's are here to hold the time
model to real runs (an H200 measured by the fidelity probe, torchtitan's published H100 tables).

A profile is chosen by name (`PROFILES`) or read from a TOML file with the same field names
(`load`); a bad file is one line naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from typing import Mapping, Optional

GB = 1e9  # card vendors quote decimal units
TERA = 1e12

# dtype families of `peak_flops`; a tensor's dtype picks one (time_model.flops_family).
DTYPE_FAMILIES = ("bf16", "fp16", "tf32", "fp32", "int8")


@dataclasses.dataclass(frozen=True)
class CardProfile:
    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]  # dense (no sparsity) per DTYPE_FAMILIES, FLOP/s (int8: op/s)
    memory_bandwidth: float  # bytes/s, the memory's peak
    host_link: str  # e.g. "PCIe 5.0 x16"
    host_link_bandwidth: float  # bytes/s per direction
    card_link: str  # e.g. "NVLink 4 (switch, all-to-all within a host)"
    card_link_bandwidth: float  # bytes/s per direction, all of one card's ports together
    launch_latency: float  # seconds the card takes from one kernel to the next on a stream
    power_watts: float  # what the figures assume; not modelled (docs: limits)


def _pcie5_x16() -> float:
    # PCIe 5.0: 32 GT/s per lane, 128b/130b encoding -> 3.94 GB/s per lane per direction, x16 63 GB/s.
    return 16 * 32e9 * 128 / 130 / 8


# Kernel launch latency: back-to-back kernels on one stream of a Hopper card start a few
# microseconds apart; NVIDIA's CUDA Graphs material quotes "a few microseconds" per launch, which
# graphs remove. 3 us is taken for every card here; Biren publishes no figure.
_LAUNCH_LATENCY = 3e-6

def _hopper(name: str, memory_gb: int, bandwidth: float, watts: float) -> CardProfile:
    """An NVIDIA Hopper SXM card. NVIDIA's H100 and H200 datasheets (dense = half the "with
    sparsity" figures): 989 TFLOPS bf16/fp16, 495 TF32, 67 fp32 (non-tensor), 1,979 TOPS int8;
    NVLink 4, 900 GB/s both directions together (450 each way); PCIe Gen5 x16."""
    return CardProfile(
        name=name, memory_bytes=memory_gb * 10**9,
        peak_flops={"bf16": 989.4 * TERA, "fp16": 989.4 * TERA, "tf32": 494.7 * TERA, "fp32": 66.9 * TERA,
                    "int8": 1978.9 * TERA},
        memory_bandwidth=bandwidth, host_link="PCIe 5.0 x16", host_link_bandwidth=_pcie5_x16(),
        card_link="NVLink 4 (all-to-all within a host)", card_link_bandwidth=450 * GB,
        launch_latency=_LAUNCH_LATENCY, power_watts=watts)


PROFILES = {
    # Biren BR100: Biren's product page and its Hot Chips 34 (2022) talk: 1,024 TFLOPS bf16/fp16,
    # 512 TFLOPS TF32+, 256 TFLOPS fp32, 2,048 TOPS int8; 64 GB HBM2e at 1.64 TB/s; 8 B-Link ports,
    # 2.3 TB/s together (taken as 1.15 TB/s per direction); PCIe 5.0 x16; 550 W OAM module.
    "BR100": CardProfile(
        name="BR100", memory_bytes=64 * 2**30,
        peak_flops={"bf16": 1024 * TERA, "fp16": 1024 * TERA, "tf32": 512 * TERA, "fp32": 256 * TERA,
                    "int8": 2048 * TERA},
        memory_bandwidth=1640 * GB, host_link="PCIe 5.0 x16", host_link_bandwidth=_pcie5_x16(),
        card_link="B-Link, 8 ports", card_link_bandwidth=1150 * GB, launch_latency=_LAUNCH_LATENCY,
        power_watts=550),
    # Biren BR104: the same sources: half BR100's throughput (512 TFLOPS bf16, 256 TF32+, 128 fp32,
    # 1,024 TOPS int8); 32 GB HBM2e at 819 GB/s; a PCIe 5.0 x16 card, 300 W. Its cards talk over
    # PCIe here (no B-Link figure is published for the PCIe card).
    "BR104": CardProfile(
        name="BR104", memory_bytes=32 * 2**30,
        peak_flops={"bf16": 512 * TERA, "fp16": 512 * TERA, "tf32": 256 * TERA, "fp32": 128 * TERA,
                    "int8": 1024 * TERA},
        memory_bandwidth=819 * GB, host_link="PCIe 5.0 x16", host_link_bandwidth=_pcie5_x16(),
        card_link="PCIe 5.0 x16 (peer to peer)", card_link_bandwidth=_pcie5_x16(), launch_latency=_LAUNCH_LATENCY,
        power_watts=300),
    # NVIDIA H100 SXM5 80 GB, NVIDIA's H100 Tensor Core GPU datasheet: 80 GB HBM3 at 3.35 TB/s; up to
    # 700 W; throughput and links as _hopper says.
    "H100-SXM-80GB": _hopper("H100-SXM-80GB", 80, 3350 * GB, 700),
    # The H100 of Meta's Grand Teton hosts that torchtitan's published benchmarks ran on
    # (torchtitan's performance page and its benchmarks folder: 96 GB HBM2e at 2.4 TB/s, 8 GPUs per host
    # fully connected with NVLink, 400 Gb/s RDMA per GPU, run at the default 500 W limit). NVIDIA
    # publishes no datasheet for it; torchtitan's paper says its peak lies between the SXM's and the
    # NVL's; torchtitan's own MFU uses the SXM figure, taken here too.
    "H100-96GB-HBM2e": _hopper("H100-96GB-HBM2e", 96, 2400 * GB, 500),
    # NVIDIA H200 SXM, NVIDIA's H200 datasheet: the H100 SXM's throughput (989 TFLOPS bf16 dense,
    # 1,979 with sparsity) and links; 141 GB HBM3e at 4.8 TB/s; up to 700 W. The card the fidelity
    # probe measures (tests/data/fidelity/).
    "H200": _hopper("H200", 141, 4800 * GB, 700),
}
DEFAULT_CARD = "BR104"


class ProfileError(ValueError):
    """A card profile that cannot be used: one line naming the field."""


_NUMBERS = ("memory_bytes", "memory_bandwidth", "host_link_bandwidth", "card_link_bandwidth", "launch_latency",
            "power_watts")


def from_fields(fields: dict, where: str) -> CardProfile:
    """A profile from a table of its fields (as a TOML file spells them), checked field by field."""
    known = {f.name for f in dataclasses.fields(CardProfile)}
    for key in fields:
        if key not in known:
            raise ProfileError(f"{where}: unknown field {key!r}; the fields are {', '.join(sorted(known))}")
    for key in sorted(known):
        if key not in fields:
            raise ProfileError(f"{where}: field {key!r} is missing")
    for key in ("name", "host_link", "card_link"):
        if not isinstance(fields[key], str) or not fields[key]:
            raise ProfileError(f"{where}: field {key!r} must be a non-empty string, got {fields[key]!r}")
    for key in _NUMBERS:
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                value == 0 and key != "launch_latency"):
            raise ProfileError(f"{where}: field {key!r} must be a positive number, got {value!r}")
    peaks = fields["peak_flops"]
    if not isinstance(peaks, dict):
        raise ProfileError(f"{where}: field 'peak_flops' must be a table of {', '.join(DTYPE_FAMILIES)}")
    for family in DTYPE_FAMILIES:
        value = peaks.get(family)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ProfileError(f"{where}: field 'peak_flops.{family}' must be a positive number (FLOP/s), "
                               f"got {value!r}")
    extra = sorted(set(peaks) - set(DTYPE_FAMILIES))
    if extra:
        raise ProfileError(f"{where}: unknown field 'peak_flops.{extra[0]}'; the dtype families are "
                           f"{', '.join(DTYPE_FAMILIES)}")
    return CardProfile(**{**fields, "peak_flops": dict(peaks), "memory_bytes": int(fields["memory_bytes"])})


def load(path: str) -> CardProfile:
    """The profile in a TOML file (the fields of CardProfile; peak_flops a table)."""
    try:
        with open(path, "rb") as source:
            fields = tomllib.load(source)
    except OSError as error:
        raise ProfileError(f"{path}: cannot read the card profile: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ProfileError(f"{path}: not a TOML file: {error}") from None
    return from_fields(fields, path)


def choose(card: Optional[str]) -> CardProfile:
    """`--card`'s profile: a name in PROFILES, or a .toml file; None gives DEFAULT_CARD."""
    card = card or DEFAULT_CARD
    if card in PROFILES:
        return PROFILES[card]
    if card.endswith(".toml") or os.path.sep in card:
        return load(card)
    raise ProfileError(f"--card {card}: no such card; the cards are {', '.join(PROFILES)}, or a profile file "
                       f"(.toml) with the fields of supa_emu.card_profiles.CardProfile")


def as_fields(profile: CardProfile) -> dict:
    """The profile as its fields (JSON and TOML spell it so)."""
    return {**dataclasses.asdict(profile), "peak_flops": dict(profile.peak_flops)}
