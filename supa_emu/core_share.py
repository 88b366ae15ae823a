"""A rank's share of the host's cores.

On a card a rank's host threads only launch kernels. Under emulation they compute them, and
the ranks of a job share the host's cores: with PyTorch's default (an OpenMP team as wide as
the host in every rank), each rank's spinning workers take the cores the others need (the
2-rank quick start on 2 cores, backward on the calling thread: 11-13 ms a step with one thread
per rank, 90-175 ms with two). So each rank takes its share, as torchrun does for CPU jobs
(OMP_NUM_THREADS=1 for several ranks): intra-op threads = the host's threads // the ranks on
this host, at least 1.

How many ranks run here: the launcher's LOCAL_WORLD_SIZE (torchrun, accelerate) or LOCAL_SIZE
(the deepspeed launcher), read at activation; without either, the size of the first bccl group
(mp.spawn and hand-rolled launches start every rank of an emulated job on this host).

The user's choice wins: nothing changes when OMP_NUM_THREADS is set, nor, at the first bccl
group, when torch.set_num_threads() set another count since activation.
"""

from __future__ import annotations

import logging
import os

import torch

_logger = logging.getLogger("supa_emu")
_LAUNCHER_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")

_undecided = None  # the thread count activation left while neither the user nor a launcher decided


def _launcher_local_ranks():
    for name in _LAUNCHER_VARIABLES:
        raw = os.environ.get(name)
        if raw is None:
            continue
        if raw.strip().isdigit() and int(raw) > 0:
            return int(raw), name
        _logger.warning("supa_emu: %s=%r is not a rank count; the ranks keep PyTorch's %d threads each",
                        name, raw, torch.get_num_threads())
        return None, name
    return None, None


def _share(local_ranks: int, source: str) -> None:
    threads = max(1, torch.get_num_threads() // local_ranks)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        _logger.info("supa_emu: %d intra-op thread(s) per rank (%d ranks on this host, from %s)",
                     threads, local_ranks, source)


def at_activation() -> None:
    """Take this rank's share if a launcher says how many ranks run here and the user set no count."""
    global _undecided
    _undecided = None
    if os.environ.get("OMP_NUM_THREADS"):
        return
    local_ranks, source = _launcher_local_ranks()
    if source is None:
        _undecided = torch.get_num_threads()
    elif local_ranks is not None:
        _share(local_ranks, source)


def at_first_group(size: int) -> None:
    """Take this rank's share from the first bccl group's size, unless it was decided before."""
    global _undecided
    left, _undecided = _undecided, None
    if left is not None and torch.get_num_threads() == left:
        _share(size, "the size of the first bccl group")
