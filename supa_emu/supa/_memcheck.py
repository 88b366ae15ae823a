"""Memory checker for emulated SUPA cards (`torch.supa._memcheck`), the counterpart of
compute-sanitizer's memcheck and initcheck: an operator that would fault on a card (an operand
outside its storage's live allocation, a storage freed or shrunk under a view) raises here before
it touches a byte, where the CPU would read garbage or die of SIGSEGV; a read of device memory
that nothing wrote since `torch.empty` handed it out is reported with the allocation's stack.

Enable it with `SUPA_EMU_SANITIZE=memory` (`memory-strict`: uninitialised reads raise instead of
warning once per allocation site; either combines with `streams`) or `enable_memory_checker()`.
Like the stream sanitizer, a TorchDispatchMode sees every operator and the op-effects table
(`_op_effects`) says which arguments it reads and writes; the bounds and written ranges are the
native core's (`csrc/runtime/memcheck.cpp`), next to the caching allocator that knows every live
block. Collectives on `bccl` report the buffers they write through the shared switch. When it is
off nothing of this module is imported.
"""

from __future__ import annotations

import importlib
import sys
import threading
import warnings
from typing import Any, Dict, Optional

if __name__ != "supa_emu.supa._memcheck":
    # Imported as `torch.supa._memcheck`: hand out the one module whose state the hooks use.
    sys.modules[__name__] = importlib.import_module("supa_emu.supa._memcheck")

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._traceback import CapturedTraceback

from . import _sanitizer_switch
from ._runtime import _native
from ._op_effects import OpSpec, split_tensors
from ._stream_races import _MACHINERY, format_stack

__all__ = ["enable_memory_checker", "disable_memory_checker", "MemoryChecker", "IllegalAddressError",
           "UninitializedReadError", "UninitializedReadWarning", "memory_checker"]

# Operators whose fresh results hold whatever the allocator handed out.
UNINITIALIZING = frozenset({"aten::empty", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
                            "aten::empty_like", "aten::empty_permuted"})

_OUT_OF_BOUNDS, _FREED, _UNINITIALIZED = 1, 2, 3


class IllegalAddressError(torch.AcceleratorError):
    """An operand reaches outside its storage's live allocation (a card's illegal address fault)."""


class UninitializedReadError(RuntimeError):
    """An operator read device memory that nothing wrote since it was allocated (strict mode)."""


class UninitializedReadWarning(UserWarning):
    """As UninitializedReadError, reported once per allocation site (the default mode)."""


class _Dispatch(TorchDispatchMode):
    def __init__(self, checker: "MemoryChecker") -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.checker._run(func, args, kwargs or {})


class MemoryChecker:
    """Checks every operand of every operator on supa tensors against the native core's facts."""

    def __init__(self) -> None:
        self.enabled = False
        self.strict = False
        self.warned_sites: set = set()  # allocation sites already reported (warning mode)
        self.checked = 0  # operators whose operands were checked
        self._capturing = False  # a graph is being captured
        self._specs: Dict[Any, OpSpec] = {}
        self._dispatch: Optional[_Dispatch] = None
        self._lock = threading.Lock()

    def enable(self, strict: bool = False) -> None:
        """Start checking. Enter in the thread that runs the model; autograd's worker threads
        inherit the mode."""
        self.strict = strict
        if self.enabled:
            return
        self._core = _native()
        self._core._memcheck_enable(True)
        self.warned_sites = set()
        self._dispatch = _Dispatch(self)
        _sanitizer_switch.start(self, self._dispatch)
        self.enabled = True

    def disable(self) -> None:
        if self.enabled:
            self.enabled = False
            _sanitizer_switch.stop(self, self._dispatch)
            self._dispatch = None
            self._core._memcheck_enable(False)

    # ---- operators -----------------------------------------------------------------------------
    def _run(self, func, args, kwargs):
        spec = self._specs.get(func)
        if spec is None:
            spec = self._specs[func] = OpSpec(func)
        if spec.metadata_only:
            return func(*args, **kwargs)
        reads: list = []
        writes: list = []
        for index, name, is_write in spec.arguments:
            value = args[index] if 0 <= index < len(args) else kwargs.get(name)
            if value is None:
                continue
            split_tensors(value, writes if is_write else reads)
        if reads or writes:
            self.checked += 1
            # While a graph captures, a card only records kernels: nothing is read yet (the
            # emulator runs them, but what they read then is not what a replay reads), so
            # reads are checked for bounds only, in the same order.
            fault = self._core._memcheck_operands(*(([], reads + writes) if self._capturing else (reads, writes)))
            if fault is not None:
                self._report(spec.name, fault, reads, writes, args, kwargs, spec)
        result = func(*args, **kwargs)
        if writes:
            # An in-place or out= write covers its operand's extent from now on (for initcheck
            # that is all a write needs to say; partial writes count whole, never a false report).
            self._core._memcheck_written(writes)
        if spec.name in UNINITIALIZING:
            if isinstance(result, torch.Tensor):
                self._core._memcheck_uninitialized(result)
        elif spec.fresh_returns and self._core._memcheck_tracked_blocks():
            # A kernel may grow a fresh result's storage (resize_, which the native core tracks)
            # and fill it where no operator is seen: what an operator returns is written.
            fresh: list = []
            for i in spec.fresh_returns:
                split_tensors(result if len(spec.fresh_returns) == 1 and not isinstance(result, tuple)
                              else result[i], fresh)
            self._core._memcheck_written(fresh)
        return result

    def _report(self, op: str, fault: tuple, reads: list, writes: list, args, kwargs, spec: OpSpec) -> None:
        kind, operand, lo, hi, live, base, first_unwritten, site = fault
        tensor = (reads + writes)[operand]
        name = _operand_name(spec, args, kwargs, tensor)
        action = "reads" if operand < len(reads) else "writes"
        what = (f"argument '{name}' (shape {list(tensor.shape)}, stride {list(tensor.stride())}, storage offset "
                f"{tensor.storage_offset()}, {tensor.dtype}, supa:{tensor.get_device()})")
        stack = format_stack(CapturedTraceback.extract())
        if kind == _UNINITIALIZED:
            site_lines = _format_frames(site)
            key = site_lines or f"{base:#x}"
            text = (f"SUPA memory checker: uninitialized read: {op} reads {what}: byte {first_unwritten} of the "
                    f"allocation at {base:#x} ({live} bytes) was never written by an operator, copy or fill since "
                    f"it was allocated uninitialised (torch.empty and friends, or the grown part of a resized "
                    f"storage)\n"
                    f"Allocation site:\n{site_lines or '    (no stack recorded)'}\n"
                    f"Stack of this access:\n{stack}")
            if self.strict:
                raise UninitializedReadError(text)
            # Reported once per site; the bytes read count as written from now on, so later reads
            # of the same memory are not checked again element by element.
            self._core._memcheck_written([tensor])
            with self._lock:
                if key in self.warned_sites:
                    return
                self.warned_sites.add(key)
            frame = sys._getframe(1)
            while frame.f_back is not None and any(part in frame.f_code.co_filename for part in _OWN_FRAMES):
                frame = frame.f_back  # attributed to the user's line, not to the dispatch machinery
            warnings.warn_explicit(text, UninitializedReadWarning, frame.f_code.co_filename, frame.f_lineno,
                                   module=frame.f_globals.get("__name__"), registry=frame.f_globals.setdefault(
                                       "__warningregistry__", {}))
            return
        if kind == _FREED or base == 0:
            where = ("but its storage holds no memory: it was freed or resized to 0 bytes while this tensor "
                     "still used it")
        else:
            where = (f"outside its storage's live allocation of {live} bytes at {base:#x} (bytes [0, {live})); "
                     f"the storage was shrunk while this tensor still used it, or a view (set_, as_strided) "
                     f"was made past its end")
        raise IllegalAddressError(
            f"SUPA memory checker: illegal address: {op} {action} {what} at bytes [{lo}, {hi}) of its storage, "
            f"{where}. Nothing was read or written (a card would fault here).\nStack of this access:\n{stack}")

    # ---- hooks of the shared switch (collectives, graphs) ---------------------------------------
    def collective_issued(self, work, group: str, accesses, op: str) -> None:
        """A bccl collective writes its output buffers (outside any operator)."""
        written = [t for t, _, w in accesses if w and not t.is_cpu and t.get_device() >= 0]
        if written:
            self._core._memcheck_written(written)

    def written_outside_operators(self, tensors) -> None:
        """Memory that native code wrote outside any operator (torch.supa.bccl's copies)."""
        self._core._memcheck_written([t for t in tensors if not t.is_cpu])

    def work_waited(self, work) -> None:
        pass  # the memory a collective writes is counted as written when it is issued

    def graph_capture_begin(self, graph) -> None:
        self._capturing = True

    def graph_capture_end(self, graph) -> None:
        self._capturing = False

    def graph_replayed(self, graph) -> None:
        pass  # a replay writes what the captured operators wrote, already counted


def _operand_name(spec: OpSpec, args, kwargs, tensor: torch.Tensor) -> str:
    for index, name, _ in spec.arguments:
        value = args[index] if 0 <= index < len(args) else kwargs.get(name)
        if value is tensor:
            return name
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if item is tensor:
                    return f"{name}[{i}]"
    return "?"


_OWN_FRAMES = (*_MACHINERY, "torch/_ops.py", "torch/_tensor.py", "torch/utils/_device.py")


def _format_frames(frames: Optional[list]) -> str:
    """The allocation stack the native core recorded (dicts of name, filename, line), innermost last."""
    if not frames:
        return ""
    lines = [f'  File "{f["filename"]}", line {f["line"]}, in {f["name"]}\n' for f in reversed(frames)]
    return "".join(line for line in lines if not any(part in line for part in _OWN_FRAMES))


memory_checker = MemoryChecker()


def enable_memory_checker(strict: bool = False) -> None:
    """Turn the memory checker on for this process.

    From now on an operator whose supa operand lies outside its storage's live allocation raises
    `IllegalAddressError` before running; a read of memory never written since `torch.empty` (and
    friends) allocated it warns `UninitializedReadWarning` once per allocation site, or raises
    `UninitializedReadError` with `strict`.
    """
    memory_checker.enable(strict=strict)


def disable_memory_checker() -> None:
    """Stop checking; the written ranges are dropped."""
    memory_checker.disable()
