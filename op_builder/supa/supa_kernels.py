"""Finds torch_supa_ext's compiled `torch.ops.deepspeed.*` kernels and probes whether they work.

torch_supa_ext registers some DeepSpeed ops with real SUPA kernels and others as stubs that raise
NotImplementedError when called (`lamb`, `softmax`, ...). Only a call tells them apart, so an op
counts as usable on a device type once a tiny probe call on that device type has succeeded.
"""

import functools
import threading

import torch

_lock = threading.Lock()
_usable = {}  # (op name, device type) -> op packet or None


@functools.lru_cache(maxsize=None)
def extension_status():
    """(True, '') if `import torch_supa_ext` works here, else (False, why it does not)."""
    try:
        import torch_supa_ext  # noqa: F401  (importing registers the deepspeed:: ops)
    except Exception as err:  # ImportError, or the extension's own ABI check failing
        return False, f"torch_supa_ext is not importable ({type(err).__name__}: {err})"
    return True, ''


def registered_op(name, namespace='deepspeed'):
    """The `torch.ops.<namespace>.<name>` packet when torch_supa_ext is importable and registers it, else None."""
    if not extension_status()[0]:
        return None
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


def usable_kernel(name, device, probe):
    """The op `name` if it runs on `device`'s type, else None.

    `probe(op, device)` makes one tiny call; NotImplementedError (a stub, or no kernel for this
    device type) or any other failure means the fallback is used. Answers are cached per device type.
    """
    key = (name, torch.device(device).type)
    with _lock:
        if key in _usable:
            return _usable[key]
    op = registered_op(name)
    if op is not None:
        try:
            probe(op, torch.device(device))
        except Exception:
            op = None
    with _lock:
        _usable[key] = op
    return op


def forget_probes():
    """Drop cached answers (tests that install or remove an extension mid-process)."""
    with _lock:
        _usable.clear()
    extension_status.cache_clear()
