"""Single-process multi-card collectives (`torch.supa.bccl`; `torch.cuda.nccl` under transfer_to_supa).

The API and argument rules of torch.cuda.nccl: each input (and output) lives on its own card,
dense, contiguous, one dtype, equal element counts. Ranks are the inputs' positions, or the
ranks of the communicators passed as `comms` (from `init_rank`, one per input, bound to the
input's card). Ops are ncclRedOp_t codes: 0 SUM, 1 PROD, 2 MAX, 3 MIN, 4 AVG. Bad arguments raise
what PyTorch's NCCL bindings raise: TypeError for something that is not a sequence of tensors,
RuntimeError for tensors or counts that do not fit (and for what would make NCCL wait forever,
such as communicators of another size), IndexError where torch.cuda.nccl indexes a list. The
emulated library is BCCL_VERSION (see `version`). The data movement is in `_bccl_kernels`.
"""

from __future__ import annotations

import collections.abc
import operator
import os
import warnings
from typing import Any, Optional, Sequence

import torch

from supa_emu.device_type import DEVICE_TYPE
from supa_emu.supa import _bccl_kernels as kernels, _sanitizer_switch

__all__ = ["is_available", "version", "unique_id", "init_rank", "all_reduce", "reduce", "broadcast",
           "all_gather", "reduce_scatter"]

SUM = 0  # ncclRedOp_t-style reduction code

# The emulated library's version, in NCCL's numbering (BCCL keeps NCCL's API): 2.18.1, the NCCL
# release PyTorch paired with CUDA 12.1, which is what torch.version.cuda reports under transfer.
# At or past 2.10, so code that gates on NCCL >= 2.10 (AVG, bfloat16) takes the path BCCL serves.
BCCL_VERSION = (2, 18, 1)
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_INVALID_ARGUMENT = "BCCL Error 4: invalid argument"  # ncclInvalidArgument
_INVALID_USAGE = "BCCL Error 5: invalid usage"  # ncclInvalidUsage
_OPS = "0 (SUM), 1 (PROD), 2 (MAX), 3 (MIN), 4 (AVG)"


class Communicator:
    """One rank of a BCCL communicator (what `init_rank` returns), bound to the card that was
    current when it was made. Pass one per input, in `comms`, to the collectives."""

    __slots__ = ("uid", "num_ranks", "rank", "device")

    def __init__(self, uid: bytes, num_ranks: int, rank: int, device: int) -> None:
        self.uid, self.num_ranks, self.rank, self.device = uid, num_ranks, rank, device

    def __repr__(self) -> str:
        return f"<torch.supa.bccl.Communicator rank {self.rank} of {self.num_ranks} on supa:{self.device}>"


def _check_sequence(inputs: Any) -> None:
    if not isinstance(inputs, collections.abc.Container) or isinstance(inputs, torch.Tensor):
        raise TypeError("Inputs should be a collection of tensors")


def is_available(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `tensors` can go to a collective: dense, contiguous supa tensors on distinct cards."""
    devices = set()
    for tensor in tensors:
        if tensor.is_sparse or not tensor.is_contiguous() or tensor.device.type != DEVICE_TYPE:
            return False
        if tensor.get_device() in devices:
            return False
        devices.add(tensor.get_device())
    return True


def version() -> tuple[int, ...]:
    """The BCCL version as (major, minor, patch), NCCL's numbering (a 4th item would be a suffix)."""
    return BCCL_VERSION


def unique_id() -> bytes:
    """A fresh 128-byte communicator id for `init_rank`."""
    return os.urandom(UNIQUE_ID_BYTES)


def init_rank(num_ranks: int, uid: bytes, rank: int) -> Communicator:
    """Rank `rank` of the `num_ranks`-rank communicator `uid`, on the current card.

    Raises TypeError for arguments of the wrong type, RuntimeError for an id that is not 128
    bytes or a rank outside [0, num_ranks).
    """
    num_ranks, rank = _integer(num_ranks, "num_ranks"), _integer(rank, "rank")
    if isinstance(uid, str):
        uid = uid.encode()
    if not isinstance(uid, (bytes, bytearray)):
        raise TypeError(f"init_rank: uid must be bytes from unique_id(), got {type(uid).__name__}")
    if len(uid) != UNIQUE_ID_BYTES:
        raise RuntimeError(f"invalid unique_id (expected {UNIQUE_ID_BYTES} bytes, got {len(uid)})")
    if num_ranks < 1 or not 0 <= rank < num_ranks:
        raise RuntimeError(f"{_INVALID_ARGUMENT}: rank {rank} of a communicator of {num_ranks} ranks "
                           f"(ranks run from 0 to num_ranks - 1)")
    return Communicator(bytes(uid), num_ranks, rank, torch.supa.current_device())


def all_reduce(inputs: Sequence[torch.Tensor], outputs: Optional[Sequence[torch.Tensor]] = None,
               op: int = SUM, streams: Any = None, comms: Any = None) -> None:
    """Every output (default: the inputs, in place) gets the reduction of all inputs."""
    _check_sequence(inputs)
    if outputs is None:
        outputs = inputs
    _check_sequence(outputs)
    inputs, outputs = _tensors(inputs), _tensors(outputs)
    op = _integer(op, "op")
    order = _unpack(inputs, streams, comms)
    input_views, output_views = _operands(inputs, outputs, 1, 1)
    _check_op(op, inputs[0])
    kernels.all_reduce(_ranked(input_views, order), _ranked(output_views, order), op)
    _written(outputs)


# `output` used to be `outputs`, a list of tensors; both are accepted as torch.cuda.nccl does.
def reduce(inputs: Sequence[torch.Tensor], output: Any = None, root: int = 0, op: int = SUM,
           streams: Any = None, comms: Any = None, *, outputs: Any = None) -> None:
    """`output` (default: inputs[root]) on card `root` gets the reduction of all inputs."""
    _check_sequence(inputs)
    if outputs is not None:
        if output is not None:
            raise ValueError("bccl.reduce: pass either 'output' (one tensor) or the deprecated 'outputs' "
                             "(a list), not both; the signature is reduce(inputs, output=None, root=0, "
                             "op=SUM, streams=None, comms=None)")
        warnings.warn("bccl.reduce with a list of output tensors is deprecated; pass the root's output "
                      "tensor as 'output'", FutureWarning, stacklevel=2)
        output = outputs[root]
    elif not isinstance(output, torch.Tensor) and isinstance(output, collections.abc.Sequence):
        warnings.warn("bccl.reduce with a list of output tensors is deprecated; pass the root's output "
                      "tensor", FutureWarning, stacklevel=2)
        output = output[root]
    elif output is None:
        output = inputs[root]
    inputs, (output,) = _tensors(inputs), _tensors([output], "output")
    root, op = _integer(root, "root"), _integer(op, "op")
    order = _unpack(inputs, streams, comms)
    _check_root(root, inputs)
    input_views, _ = _operands(inputs, [], 1, 1)
    _check_output(output, inputs[root], root, 1, 1)
    _check_op(op, inputs[0])
    rank_of_root = root if order is None else order.index(root)
    if rank_of_root != root:
        raise RuntimeError(f"{_INVALID_ARGUMENT}: root {root} names rank {root} of the communicator, "
                           f"but inputs[{root}] (which gets the output) is rank {rank_of_root}")
    kernels.reduce_into(kernels.flat_host_view(output), _ranked(input_views, order), op, own=root)
    _written([output])


def broadcast(inputs: Sequence[torch.Tensor], root: int = 0, streams: Any = None, comms: Any = None) -> None:
    """Every input gets a copy of the input of rank `root`."""
    _check_sequence(inputs)
    inputs = _tensors(inputs)
    root = _integer(root, "root")
    _check_root(root, inputs)
    order = _unpack(inputs, streams, comms)
    views, _ = _operands(inputs, [], 1, 1)
    _check_dtype(inputs[0])
    kernels.broadcast(_ranked(views, order), root)
    _written(inputs)


def all_gather(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], streams: Any = None,
               comms: Any = None) -> None:
    """Every output (len(inputs) times an input's size) gets all inputs concatenated in rank order."""
    _check_sequence(inputs)
    _check_sequence(outputs)
    inputs, outputs = _tensors(inputs), _tensors(outputs)
    order = _unpack(inputs, streams, comms)
    input_views, output_views = _operands(inputs, outputs, len(inputs), 1)
    _check_dtype(inputs[0])
    kernels.all_gather(_ranked(input_views, order), _ranked(output_views, order))
    _written(outputs)


def reduce_scatter(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], op: int = SUM,
                   streams: Any = None, comms: Any = None) -> None:
    """Output of rank r (an input's size / len(inputs)) gets chunk r of the reduction of all inputs."""
    _check_sequence(inputs)
    _check_sequence(outputs)
    inputs, outputs = _tensors(inputs), _tensors(outputs)
    op = _integer(op, "op")
    order = _unpack(inputs, streams, comms)
    input_views, output_views = _operands(inputs, outputs, 1, len(inputs))
    _check_op(op, inputs[0])
    kernels.reduce_scatter(_ranked(input_views, order), _ranked(output_views, order), op)
    _written(outputs)


def _written(tensors: list[torch.Tensor]) -> None:
    # The copies above run outside any operator, where the checkers cannot see them: say so.
    checker = _sanitizer_switch.active()
    if checker is not None:
        checker.written_outside_operators(tensors)


# ---- argument unpacking and checks (the order and exception types of PyTorch's NCCL bindings) ----

def _integer(value: Any, name: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"bccl: '{name}' must be an integer, got {type(value).__name__}") from None


def _tensors(sequence: Any, name: str = "inputs") -> list[torch.Tensor]:
    tensors = list(sequence)
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"bccl: expected Tensor at {position} of {name} (got {type(tensor).__name__})")
    return tensors


def _unpack(inputs: list[torch.Tensor], streams: Any, comms: Any) -> Optional[list[int]]:
    """Checks `streams` and `comms`; returns the input positions in rank order (None: as given)."""
    if streams is not None:
        streams = list(streams) if isinstance(streams, collections.abc.Iterable) else streams
        if not isinstance(streams, list) or any(
                s is not None and not (isinstance(s, torch.Stream) and s.device.type == DEVICE_TYPE) for s in streams):
            raise TypeError("bccl: streams must be a sequence of torch.supa.Stream or None, one per input")
        if len(streams) != len(inputs):
            raise RuntimeError(f"number of streams ({len(streams)}) is not equal to number of inputs "
                               f"({len(inputs)})")
        for position, (stream, tensor) in enumerate(zip(streams, inputs)):
            if stream is not None and tensor.device.type == DEVICE_TYPE and stream.device != tensor.device:
                raise RuntimeError(f"bccl: stream {position} is on {stream.device}, but input {position} "
                                   f"is on {tensor.device}; give each input a stream of its card")
    if comms is None:
        return None
    if isinstance(comms, Communicator):
        comms = [comms]
    elif not isinstance(comms, collections.abc.Iterable):
        raise TypeError(f"comm is not a sequence: expected communicators from torch.supa.bccl.init_rank, "
                        f"got {type(comms).__name__}")
    comms = list(comms)
    for position, comm in enumerate(comms):
        if not isinstance(comm, Communicator):
            raise ValueError(f"bccl: comms[{position}] is a {type(comm).__name__}, not a communicator "
                             "from torch.supa.bccl.init_rank")
    if len(comms) != len(inputs):
        raise RuntimeError(f"number of communicators ({len(comms)}) is not equal to number of inputs "
                           f"({len(inputs)})")
    _check_communicators(inputs, comms)
    return sorted(range(len(comms)), key=lambda position: comms[position].rank)


def _check_communicators(inputs: list[torch.Tensor], comms: list[Communicator]) -> None:
    """What would make BCCL wait forever or refuse: not one whole communicator, or a card mismatch."""
    if len({comm.uid for comm in comms}) != 1:
        raise RuntimeError(f"{_INVALID_USAGE}: the communicators come from different init_rank ids; "
                           "pass the ranks of one communicator")
    if comms[0].num_ranks != len(comms) or sorted(comm.rank for comm in comms) != list(range(len(comms))):
        raise RuntimeError(f"{_INVALID_USAGE}: the communicator has {comms[0].num_ranks} ranks, but ranks "
                           f"{sorted(comm.rank for comm in comms)} were passed; a single-process collective "
                           "needs every rank, once (the missing ones would be waited for forever)")
    for position, (comm, tensor) in enumerate(zip(comms, inputs)):
        if tensor.device.type == DEVICE_TYPE and comm.device != tensor.get_device():
            raise RuntimeError(f"{_INVALID_ARGUMENT}: comms[{position}] was made on supa:{comm.device}, but "
                               f"input {position} is on {tensor.device}")


def _check_root(root: int, inputs: list[torch.Tensor]) -> None:
    if not 0 <= root < len(inputs):
        raise RuntimeError(f"invalid root {root}: expected 0 <= root < {len(inputs)} (the number of inputs)")


def _check_tensor(tensor: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    if tensor.device.type != DEVICE_TYPE or tensor.is_sparse:
        raise RuntimeError(f"input and output elements have to be dense supa tensors; {what} is a "
                           f"{tensor.layout} tensor on {tensor.device}")
    if tensor.dtype != dtype:
        raise RuntimeError(f"all inputs and outputs must be of the same dtype; {what} is {tensor.dtype}, "
                           f"inputs[0] is {dtype}")
    if not tensor.is_contiguous():
        raise RuntimeError(f"all inputs and outputs have to be contiguous; {what} is not")


def _check_output(output: torch.Tensor, input: torch.Tensor, position: int, input_multiplier: int,
                  output_multiplier: int) -> None:
    _check_tensor(output, f"output {position}", input.dtype)
    if output.device != input.device:
        raise RuntimeError(f"input and output must be on the same device; input {position} is on "
                           f"{input.device}, its output on {output.device}")
    if output.numel() * output_multiplier != input.numel() * input_multiplier:
        raise RuntimeError(f"output must be of size input_size * size_multiplier: output {position} has "
                           f"{output.numel()} elements, expected {input.numel() * input_multiplier // output_multiplier}")


def _check_inputs(inputs: list[torch.Tensor], outputs: list[Optional[torch.Tensor]], input_multiplier: int,
                  output_multiplier: int) -> None:
    """torch.cuda.nccl's rules: output numel x output_multiplier == input numel x input_multiplier."""
    if not inputs:
        raise RuntimeError("input sequence can't be empty")
    if len(outputs) != len(inputs):
        raise RuntimeError(f"inputs and outputs sequences have to be of the same length, but got input of "
                           f"length {len(inputs)} and output of length {len(outputs)}")
    numel, dtype, devices = inputs[0].numel(), inputs[0].dtype, set()
    for position, (tensor, output) in enumerate(zip(inputs, outputs)):
        _check_tensor(tensor, f"input {position}", dtype)
        if tensor.numel() != numel:
            raise RuntimeError(f"all inputs must have the same number of elements; input {position} has "
                               f"{tensor.numel()}, input 0 has {numel}")
        if output is not None:
            _check_output(output, tensor, position, input_multiplier, output_multiplier)
        if tensor.get_device() in devices:
            raise RuntimeError(f"inputs must be on unique devices; input {position} is on {tensor.device} too")
        devices.add(tensor.get_device())


_DTYPES = kernels.NUMERIC_DTYPES | kernels.BYTE_DTYPES


def _check_dtype(tensor: torch.Tensor) -> None:
    if tensor.dtype not in _DTYPES:
        supported = ", ".join(sorted(str(d).replace("torch.", "") for d in _DTYPES))
        raise RuntimeError(f"Unconvertible BCCL type {tensor.dtype}; BCCL moves {supported}")


def _check_op(op: int, tensor: torch.Tensor) -> None:
    _check_dtype(tensor)
    if not kernels.SUM <= op <= kernels.AVG:
        raise RuntimeError(f"{_INVALID_ARGUMENT}: op {op} is not a reduction; ops are {_OPS}")


def _operands(inputs: list[torch.Tensor], outputs: list[torch.Tensor], input_multiplier: int,
              output_multiplier: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Flat host views of `inputs` and `outputs` (may be empty) after torch.cuda.nccl's checks:
    one native call when they pass, the checks in Python (which raise) when not."""
    views = kernels.checked_operands(inputs, outputs, input_multiplier, output_multiplier)
    if views is None:
        _check_inputs(inputs, outputs or [None] * len(inputs), input_multiplier, output_multiplier)
        views = ([kernels.flat_host_view(t) for t in inputs], [kernels.flat_host_view(t) for t in outputs])
    return views


def _ranked(views: list[torch.Tensor], order: Optional[list[int]]) -> list[torch.Tensor]:
    """The views in rank order (None: the inputs' order), as the kernels take them."""
    if views and views[0].dtype in kernels.BYTE_DTYPES:
        views = [kernels.as_operand(view) for view in views]
    return views if order is None else [views[position] for position in order]
