"""Single-process multi-device collectives (`torch.supa.bccl`), the analogue of torch.cuda.nccl.

The emulator does not provide this direct-call API; collectives go through torch.distributed
with backend 'bccl'. `is_available` still validates its input like the real one and answers
False; every collective raises a RuntimeError that says what to use instead.
"""

from __future__ import annotations

import collections.abc
import warnings
from typing import Any, Optional, Sequence

import torch

__all__ = ["is_available", "version", "unique_id", "init_rank", "all_reduce", "reduce", "broadcast",
           "all_gather", "reduce_scatter"]

SUM = 0  # ncclRedOp_t-style reduction code

_UNSUPPORTED = (
    "torch.supa.bccl.{name}() is not provided by the SUPA emulator: it has no single-process "
    "multi-device collective library. Use torch.distributed with backend 'bccl' "
    "(torch.distributed.init_process_group('bccl')) instead.")


_LIST_OUTPUT_DEPRECATED = ("bccl.reduce: a list of output tensors is deprecated; pass the single "
                           "output tensor of the root device as 'output'")


def _unsupported(name: str) -> RuntimeError:
    return RuntimeError(_UNSUPPORTED.format(name=name))


def _check_sequence(inputs: Any) -> None:
    if not isinstance(inputs, collections.abc.Container) or isinstance(inputs, torch.Tensor):
        raise TypeError("Inputs should be a collection of tensors")


def is_available(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` could be used with this API: dense, contiguous, on distinct supa devices.

    Always False in the emulator (inputs that pass the checks also warn why).
    """
    devices = set()
    for tensor in tensors:
        if tensor.is_sparse or not tensor.is_contiguous() or tensor.device.type != "supa":
            return False
        index = tensor.get_device()
        if index in devices:
            return False
        devices.add(index)
    warnings.warn("PyTorch is not compiled with BCCL support")
    return False


def version() -> tuple[int, ...]:
    """Version of the single-process BCCL library. Raises RuntimeError in the emulator."""
    raise _unsupported("version")


def unique_id() -> bytes:
    """A communicator id for `init_rank`. Raises RuntimeError in the emulator."""
    raise _unsupported("unique_id")


def init_rank(num_ranks: int, uid: bytes, rank: int) -> object:
    """Create a communicator for `rank`. Raises RuntimeError in the emulator."""
    raise _unsupported("init_rank")


def all_reduce(inputs: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]] = None,
               op: int = SUM, streams: Any = None, comms: Any = None) -> None:
    """Reduce `inputs` across devices into `outputs`. Raises TypeError for a non-collection,
    RuntimeError in the emulator."""
    _check_sequence(inputs)
    raise _unsupported("all_reduce")


def reduce(inputs: Sequence[torch.Tensor], output: Any = None, root: int = 0, op: int = SUM,
           streams: Any = None, comms: Any = None, *, outputs: Any = None) -> None:
    """Reduce `inputs` into `output` on device `root`. Raises TypeError for a non-collection,
    ValueError when both `output` and `outputs` are given, RuntimeError in the emulator."""
    _check_sequence(inputs)
    if outputs is not None:
        if output is not None:
            raise ValueError("bccl.reduce: pass either 'output' (one tensor) or the deprecated "
                             "'outputs', not both")
        warnings.warn(_LIST_OUTPUT_DEPRECATED, FutureWarning)
    elif isinstance(output, collections.abc.Sequence) and not isinstance(output, torch.Tensor):
        warnings.warn(_LIST_OUTPUT_DEPRECATED, FutureWarning)
    raise _unsupported("reduce")


def broadcast(inputs: Sequence[torch.Tensor], root: int = 0, streams: Any = None, comms: Any = None) -> None:
    """Copy `inputs[root]` to the other inputs. Raises TypeError / RuntimeError as `all_reduce`."""
    _check_sequence(inputs)
    raise _unsupported("broadcast")


def all_gather(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], streams: Any = None,
               comms: Any = None) -> None:
    """Gather every input into every output. Raises TypeError / RuntimeError as `all_reduce`."""
    _check_sequence(inputs)
    _check_sequence(outputs)
    raise _unsupported("all_gather")


def reduce_scatter(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: int = SUM,
                   streams: Any = None, comms: Any = None) -> None:
    """Reduce inputs and scatter the result over outputs. Raises TypeError / RuntimeError as `all_reduce`."""
    _check_sequence(inputs)
    _check_sequence(outputs)
    raise _unsupported("reduce_scatter")
