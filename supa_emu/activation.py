"""Turns emulation on in a process: the `supa` device, `torch.supa`, `bccl`, `torch_supa`.

With a real torch_supa installed the emulator stands down (one log line) and registers
nothing, so the same code runs on real cards; otherwise it registers the device the way the
real package does (rename PrivateUse1, register the device module, generate the
tensor/module/storage helpers). Both: docs/configuration.md, "Switching to real hardware".

The one module that registers: it imports the parts it installs, and only the entry points
(`supa_emu._autoload`, `supa_emu.activate`, `import torch_supa`) import it. What it decides and
loads (the configuration, the native core) it records in `supa_emu.process_state`, where every
other module reads it.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import warnings

from supa_emu import process_state
from supa_emu.device_type import DEVICE_TYPE

log = logging.getLogger("supa_emu")

_lock = threading.Lock()

# Quantized dtypes the real package declares unsupported for the generated helpers.
_UNSUPPORTED_DTYPES = ("quint8", "quint4x2", "quint2x4", "qint32", "qint8")


def real_torch_supa_origin() -> str | None:
    """Where a real torch_supa would be imported from, or None when there is none."""
    spec = importlib.util.find_spec("torch_supa")
    if spec is None or getattr(spec.loader, "is_supa_emu_alias", False):
        return None
    return spec.origin or str(spec.submodule_search_locations)


def activate() -> bool:
    # torch first, outside the lock: under SUPA_EMULATE=1 its backend autoload calls activate()
    # itself, which must find the lock free (else an explicit supa_emu.activate() before any
    # `import torch` would wait on itself); this call then returns what that one decided.
    import torch  # noqa: F401

    with _lock:
        decided = process_state.decision()
        if decided is not None:
            return decided
        origin = real_torch_supa_origin()
        if origin is not None:
            log.warning("supa_emu: a real torch_supa is installed (%s); the emulator stands down", origin)
            process_state.record_decision(False)
            return False
        _register()
        process_state.record_decision(True)
        return True


def _register() -> None:
    import torch

    from supa_emu import compile as compile_support, config, import_hooks, native

    cfg = config.load()
    process_state.record_config(cfg)
    shapes = cfg.plan_mode == "shapes"
    beyond_host = None if shapes else config.memory_beyond_host(cfg)  # shapes mode: untouched memory is free
    if beyond_host is not None:
        warnings.warn(beyond_host, RuntimeWarning, stacklevel=2)
    core = native.load(cfg.cache_dir, cfg.cache_dir_from_env)
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    core._init(len(cfg.visible_devices), [cfg.memory_bytes] * len(cfg.visible_devices), cfg.dtype_demotion, shapes)
    core._set_blas_workspace_sizes(cfg.blas_workspace_bytes, cfg.profile.blaslt_workspace_size)
    core._choose_half_precision_kernels()  # from this CPU's flags (csrc/aten/half_precision_products.cpp)
    process_state.record_core(core)

    from supa_emu import supa as supa_module

    torch._register_device_module(DEVICE_TYPE, supa_module)
    from supa_emu.supa import _allocator_config

    if cfg.allocator_conf:
        _allocator_config.apply(cfg.allocator_conf, source=cfg.allocator_conf_source)
    _allocator_config.install_accelerator_hook()
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_storage=True,
        unsupported_dtype=[getattr(torch, name) for name in _UNSUPPORTED_DTYPES])
    torch.version.supa = "emulated"
    import_hooks.install(ext=cfg.ext)
    compile_support.install()

    from supa_emu.multiprocessing import reductions

    reductions.install()

    from supa_emu.distributed import register as register_bccl

    register_bccl()
    if cfg.plan_simulate or cfg.plan_record is not None:
        from supa_emu import plan

        plan.install(cfg.plan_simulate, cfg.plan_record)

    from supa_emu import card_time, core_share

    card_time.install(cfg.profiler_card)
    core_share.at_activation()
    if not cfg.autograd_device_threads:
        from supa_emu.supa import _autograd_threads

        _autograd_threads.run_backward_on_the_calling_thread()
    streams, memory = config.sanitize_streams(cfg.sanitize), config.sanitize_memory(cfg.sanitize)
    if streams is not None:
        from supa_emu.supa import _sanitizer

        _sanitizer.enable_supa_sanitizer(report_only=streams == "streams-report")
    if memory is not None:
        from supa_emu.supa import _memcheck

        _memcheck.enable_memory_checker(strict=memory == "memory-strict")
