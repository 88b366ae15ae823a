"""Which thread runs a backward on supa tensors, and the device threads' clean exit.

On a card, autograd runs a backward on its thread for that device (as on CUDA): that thread
only launches kernels. Under emulation it would compute them, on the host's cores, with an
OpenMP team of its own beside the calling thread's. Once libgomp manages more threads than
there are cores, it shortens the spin-wait of every team between parallel regions, so workers
sleep and must be woken for each region (measured on 2 cores: 70 context switches per small-CNN
step against 1.5 on CPU tensors), and a training step in a process of its own took 1.2-1.35x
(MLP, CNN, transformer) and 3.5x (LSTM) of the same step on CPU tensors.

So backward runs on the calling thread, as for CPU tensors:
`torch.autograd.set_multithreading_enabled(False)` on the thread that imports torch (other
threads keep PyTorch's default). SUPA_EMU_AUTOGRAD_DEVICE_THREADS=1 keeps the device threads.
Ranks that share the host's cores must then not each run a team as wide as the host, or their
spinning workers take each other's cores: supa_emu/core_share.py gives each rank its share.

An atexit hook lets the device threads (kept by the setting, or used from another thread)
finish the last backward before the interpreter shuts down (1.5 ms at exit). The caller wakes
once the gradients are ready, while the device thread still drops what the finished graph held.
Among that is a Python object: every `backward()` stashes a copy of the caller's `contextvars`
context in the thread-local state the graph carries (torch.autograd.graph,
`_engine_run_backward`), and the caller removes its own reference as soon as it wakes, so the
device thread frees it and takes the GIL to do so. If that happens while the interpreter is
shutting down, Python ends the thread with `pthread_exit`, whose unwinding through a destructor
aborts the process ("terminate called without an active exception", seen when a DDP or HF
Trainer script exits right after its last step).

So the hook (run before the shutdown starts) hands each device thread one tiny graph and
waits for it: a device thread takes its tasks in order, so by then it has let go of the user's
last graph. The tiny graph goes to the engine directly, without a stashed context, and every
tensor of it stays referenced here, so what the thread drops after it needs no GIL.
"""

import atexit
import logging

import torch
from torch.autograd.variable import Variable
from torch.utils._python_dispatch import _disable_current_modes

from supa_emu import process_state
from supa_emu.device_type import DEVICE_TYPE

_logger = logging.getLogger("supa_emu")
_kept = []  # the tiny graphs' tensors (leaf, output, incoming gradient), never freed by a device thread


def _finish_pending_backwards() -> None:
    if not process_state.is_initialized():
        return
    try:
        # No Python dispatch mode (the stream sanitizer's) in the state the tiny graphs carry either;
        # multithreading on, so that the tiny graphs reach the device threads whoever used them.
        with torch.enable_grad(), _disable_current_modes(), torch.autograd.set_multithreading_enabled(True):
            for index in range(process_state.core()._device_count()):
                device = torch.device(DEVICE_TYPE, index)
                leaf = torch.zeros((), device=device, requires_grad=True)
                output, gradient = leaf.sum(), torch.ones((), device=device)
                _kept.extend((leaf, output, gradient))
                Variable._execution_engine.run_backward(
                    (output,), (gradient,), False, False, (), allow_unreachable=True, accumulate_grad=True)
    except Exception as error:  # exiting anyway: note it, do not mask the exit status
        _logger.debug("supa_emu: could not wait for autograd's device threads at exit: %s", error)


def run_backward_on_the_calling_thread() -> None:
    torch.autograd.set_multithreading_enabled(False)


def register() -> None:
    atexit.register(_finish_pending_backwards)
