"""torch.supa device management: enumeration, selection, properties, lazy init, module surface."""

import json
import re
import threading

import pytest
import torch

supa = pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

EXPECTED_ALL = {
    "BFloat16Storage", "BFloat16Tensor", "BoolStorage", "BoolTensor", "ByteStorage", "ByteTensor",
    "CharStorage", "CharTensor", "ComplexDoubleStorage", "ComplexFloatStorage", "DoubleStorage",
    "DoubleTensor", "FloatStorage", "FloatTensor", "HalfStorage", "HalfTensor", "IntStorage",
    "IntTensor", "LongStorage", "LongTensor", "ShortStorage", "ShortTensor", "Event",
    "ExternalStream", "MemPool", "MemPoolContext", "SUPAGraph", "Stream", "StreamContext",
    "_is_compiled", "_is_in_bad_fork", "_lazy_call", "_lazy_init", "_sleep", "amp", "bccl",
    "caching_allocator_alloc", "caching_allocator_delete", "caching_allocator_enable",
    "can_device_access_peer", "check_error", "current_blas_handle", "current_device",
    "current_stream", "SUPAPluggableAllocator", "change_current_allocator", "default_generators",
    "default_stream", "device", "device_count", "empty_cache", "ipc_collect", "get_allocator_backend",
    "get_amp_supported_dtype", "get_autocast_dtype", "get_device_name", "get_device_properties",
    "get_per_process_memory_fraction", "get_rng_state", "get_rng_state_all", "graph",
    "graph_pool_handle", "init", "initial_seed", "is_autocast_enabled", "is_available",
    "is_bf16_supported", "is_current_stream_capturing", "is_initialized", "make_graphed_callables",
    "manual_seed", "manual_seed_all", "max_memory_allocated", "max_memory_cached",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_cached", "memory_reserved",
    "memory_snapshot", "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "profiler",
    "random", "reset_accumulated_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "reset_peak_memory_stats", "seed", "seed_all", "set_autocast_dtype", "set_autocast_enabled",
    "set_device", "set_per_process_memory_fraction", "set_rng_state", "set_rng_state_all",
    "set_stream", "stream", "supart", "synchronize", "use_mem_pool", "brtx",
}

PROPERTY_FIELDS = {
    "name", "major", "minor", "is_multi_gpu_board", "is_integrated", "multi_processor_count",
    "total_memory", "max_threads_per_multi_processor", "max_threads_per_block", "warp_size",
    "shared_memory_per_block", "clock_rate", "memory_clock_rate", "memory_bus_width",
    "shared_memory_per_block_optin", "shared_memory_per_multiprocessor", "regs_per_multiprocessor",
    "gcnArchName", "uuid", "pci_bus_id", "pci_device_id", "pci_domain_id", "L2_cache_size",
}

multi_device = pytest.mark.skipif(torch.supa.device_count() < 2, reason="needs two SUPA devices")


@pytest.fixture(autouse=True)
def restore_device():
    torch.supa.init()
    prev = torch.supa.current_device()
    yield
    torch.supa.set_device(prev)


def test_module_is_registered_as_torch_supa():
    assert torch.supa is supa
    assert torch.accelerator.current_accelerator().type == "supa"


def test_all_lists_the_103_names_and_each_exists():
    assert len(torch.supa.__all__) == 103
    assert set(torch.supa.__all__) == EXPECTED_ALL
    for name in torch.supa.__all__:
        assert hasattr(torch.supa, name), name


def test_names_outside_all_that_callers_use():
    for name in ("set_stream_by_id", "get_device_capability", "_get_device_index", "_exchange_device",
                 "_maybe_exchange_device", "_DeviceGuard", "autocast", "custom_fwd", "custom_bwd",
                 "get_autocast_gpu_dtype", "_set_allocator_settings", "_record_memory_history", "_snapshot"):
        assert hasattr(torch.supa, name), name


def test_module_getattr_serves_initialized_and_rejects_unknown_names():
    assert torch.supa._initialized is torch.supa.is_initialized()
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        torch.supa.no_such_thing


def test_availability_and_count():
    assert torch.supa.is_available()
    assert torch.supa.device_count() >= 1
    assert torch.supa.device_count() == torch.accelerator.device_count()
    assert torch.supa._is_compiled()
    assert torch.supa._is_in_bad_fork() is False


def test_initialised_state_and_generators():
    torch.supa.init()
    assert torch.supa.is_initialized()
    assert len(torch.supa.default_generators) == torch.supa.device_count()
    for i, gen in enumerate(torch.supa.default_generators):
        assert gen.device == torch.device("supa", i)


def test_lazy_call_runs_immediately_once_initialised():
    seen = []
    torch.supa._lazy_call(lambda: seen.append(1))
    assert seen == [1]


def test_lazy_init_in_fresh_process_runs_queued_seed(python_subprocess):
    out = python_subprocess("""
        import torch
        assert torch.supa.is_initialized() is False
        assert torch.supa.default_generators == ()
        torch.supa.manual_seed_all(1234)
        assert torch.supa.is_initialized() is False
        torch.supa.init()
        assert torch.supa.is_initialized()
        print(torch.supa.initial_seed())
    """)
    assert out.stdout.strip() == "1234"


@pytest.mark.emulation_only
def test_init_without_devices_raises(python_subprocess):
    out = python_subprocess("""
        import torch
        assert torch.supa.device_count() == 0
        assert torch.supa.is_available() is False
        try:
            torch.supa.init()
        except RuntimeError as exc:
            print(exc)
    """, env={"SUPA_VISIBLE_DEVICES": ""})
    assert out.stdout.strip() == "No BIREN GPUs are available"


def test_set_device_and_current_device():
    torch.supa.set_device(0)
    assert torch.supa.current_device() == 0
    torch.supa.set_device(-1)  # negative: silently ignored
    assert torch.supa.current_device() == 0
    torch.supa.set_device("supa:0")
    assert torch.supa.current_device() == 0


@multi_device
def test_device_context_manager_restores_previous_device():
    torch.supa.set_device(0)
    with torch.supa.device(1):
        assert torch.supa.current_device() == 1
        assert torch.empty(1, device="supa").device == torch.device("supa:1")
    assert torch.supa.current_device() == 0
    with torch.supa.device(-1):
        assert torch.supa.current_device() == 0
    with torch.supa._DeviceGuard(1):
        assert torch.supa.current_device() == 1
    assert torch.supa.current_device() == 0


@multi_device
def test_set_device_moves_default_allocations():
    torch.supa.set_device(1)
    assert torch.zeros(2, device="supa").device.index == 1


def test_get_device_index_rules():
    assert torch.supa._get_device_index(5) == 5  # ints pass through unchecked
    assert torch.supa._get_device_index("supa:0") == 0
    assert torch.supa._get_device_index(torch.device("supa", 0)) == 0
    assert torch.supa._get_device_index(None, optional=True) == torch.supa.current_device()
    assert torch.supa._get_device_index(torch.device("supa"), optional=True) == torch.supa.current_device()
    with pytest.raises(ValueError, match="Expected a supa device, but got: cpu"):
        torch.supa._get_device_index(torch.device("cpu"))
    assert torch.supa._get_device_index(torch.device("cpu"), allow_cpu=True) == -1
    with pytest.raises(RuntimeError, match="Invalid device string"):
        torch.supa._get_device_index("supa0")


def test_device_properties_fields_and_repr():
    props = torch.supa.get_device_properties(0)
    assert PROPERTY_FIELDS <= set(dir(props))
    assert props.gcnArchName == props.name
    assert props.total_memory > 0 and props.multi_processor_count > 0
    assert len(props.uuid.bytes) == 16 and all(0 <= b <= 255 for b in props.uuid.bytes)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", str(props.uuid))
    mib = 1 << 20
    assert repr(props) == (
        f"_SupaDeviceProperties(name='{props.name}', major={props.major}, minor={props.minor}, "
        f"total_memory={props.total_memory // mib}MB, multi_processor_count={props.multi_processor_count}, "
        f"uuid={props.uuid}, pci_bus_id={props.pci_bus_id}, pci_device_id={props.pci_device_id}, "
        f"pci_domain_id={props.pci_domain_id}, L2_cache_size={props.L2_cache_size // mib}MB)")
    with pytest.raises(AttributeError):
        props.name = "other"


def test_device_name_and_capability():
    props = torch.supa.get_device_properties()
    assert torch.supa.get_device_name() == props.name
    assert torch.supa.get_device_capability() == (props.major, props.minor)


def test_invalid_device_ids_raise_assertion():
    n = torch.supa.device_count()
    for bad in (n, n + 3):
        with pytest.raises(AssertionError, match="Invalid device id"):
            torch.supa.get_device_properties(bad)
        with pytest.raises(AssertionError, match="Invalid device id"):
            torch.supa.get_device_name(bad)
        with pytest.raises(AssertionError, match="Invalid device id"):
            torch.supa.get_device_capability(bad)
    with pytest.raises(AssertionError, match="Invalid peer device id"):
        torch.supa.can_device_access_peer(0, n)
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.supa.can_device_access_peer(n, 0)


@multi_device
def test_peer_access_between_distinct_devices():
    assert torch.supa.can_device_access_peer(0, 1)


@pytest.mark.emulation_only
def test_emulated_profile_matches_configuration():
    from supa_emu import activation

    cfg = activation.config()
    props = torch.supa.get_device_properties(0)
    assert props.name == cfg.profile.name
    assert props.total_memory == cfg.memory_bytes
    # The core owns the capacity: the properties and the runtime's memory info agree.
    assert props.total_memory == torch.supa.mem_get_info(0)[1]
    assert torch.supa.get_device_properties(0).uuid != torch.supa.get_device_properties(
        torch.supa.device_count() - 1).uuid or torch.supa.device_count() == 1


_synchronizations = []


def test_synchronize_and_trace_callback():
    # Registered once per process: the registry has no removal, like torch.cuda's.
    if not _synchronizations:
        torch.supa._gpu_trace.register_callback_for_device_synchronization(lambda: _synchronizations.append(1))
    before = len(_synchronizations)
    current = torch.supa.current_device()
    torch.supa.synchronize()
    torch.supa.synchronize(0)
    torch.supa.synchronize("supa:0")
    assert len(_synchronizations) - before == 3
    assert torch.supa.current_device() == current  # synchronize(device) does not switch devices
    with pytest.raises(Exception, match="invalid device ordinal"):
        torch.supa.synchronize(torch.supa.device_count())
    assert len(_synchronizations) - before == 3


def test_bf16_support_follows_reference_semantics():
    assert torch.supa.is_bf16_supported() is True
    assert torch.supa.is_bf16_supported(including_emulation=False) is False


def test_amp_supported_dtypes():
    assert torch.supa.get_amp_supported_dtype() == [torch.bfloat16, torch.float16, torch.float32]


def test_supart_and_check_error():
    rt = torch.supa.supart()
    free, total = rt.supaMemGetInfo(0)
    assert 0 <= free <= total
    assert torch.supa.check_error(rt.supaError.success) is None
    with pytest.raises(RuntimeError, match=r"\(7\)"):
        torch.supa.check_error(7)


def test_misc_runtime_helpers():
    torch.supa._sleep(100)
    with pytest.raises(RuntimeError, match="expected 'int'"):
        torch.supa._sleep(1.5)
    assert isinstance(torch.supa.current_blas_handle(), int)
    torch.supa.ipc_collect()


def test_profiler_and_brtx_ranges_run():
    with torch.supa.profiler.profile():
        with torch.supa.brtx.range("step {}", 1):
            torch.supa.brtx.mark("here")
            depth = torch.supa.brtx.range_push("inner")
            assert depth >= 1
            torch.supa.brtx.range_pop()
        rid = torch.supa.brtx.range_start("overlapping")
        torch.supa.brtx.range_end(rid)


def test_brtx_ranges_appear_in_torch_profiler():
    with torch.profiler.profile() as prof:
        with torch.supa.brtx.range("supa-emu-range"):
            torch.ones(2, device="supa") + 1
    assert any(evt.name == "supa-emu-range" for evt in prof.events())


def test_brtx_ranges_outside_the_profiler_nest_but_are_not_recorded():
    depth = torch.supa.brtx.range_push("opened-before-profiling")
    with torch.profiler.profile() as prof:
        assert torch.supa.brtx.range_push("opened-while-profiling") == depth + 1
        assert torch.supa.brtx.range_pop() == depth + 1
        torch.supa.brtx.mark("marked-while-profiling")
        assert torch.supa.brtx.range_pop() == depth  # the range opened before the profiler
    names = {event.name for event in prof.events()}
    assert {"opened-while-profiling", "marked-while-profiling"} <= names
    assert "opened-before-profiling" not in names


@pytest.mark.parametrize("device_threads", [True, False], ids=["device-thread", "calling-thread"])
def test_brtx_ranges_in_backward_hooks_are_recorded(device_threads):
    """DeepSpeed opens ranges in backward hooks: on a card those run on autograd's device thread."""
    x = torch.ones(2, device="supa", requires_grad=True)
    threads = []

    def hook(grad):
        threads.append(threading.get_ident())
        torch.supa.brtx.range_push("range-in-backward-hook")
        torch.supa.brtx.range_pop()
        return grad

    x.register_hook(hook)
    with torch.profiler.profile() as prof, torch.autograd.set_multithreading_enabled(device_threads):
        (x * 2).sum().backward()
    assert any(event.name == "range-in-backward-hook" for event in prof.events())
    assert (threads != [threading.get_ident()]) == device_threads


def test_bccl_single_process_api_input_checks():
    assert torch.supa.bccl.is_available([torch.ones(2)]) is False  # not a supa tensor
    assert torch.supa.bccl.is_available([torch.ones(4, 4, device="supa").t()]) is False  # non-contiguous
    with pytest.raises(TypeError, match="Inputs should be a collection of tensors"):
        torch.supa.bccl.all_reduce(torch.ones(2, device="supa"))


def test_gpu_trace_registries_have_reference_names():
    from torch.supa import _gpu_trace

    assert _gpu_trace.DeviceSynchronizationCallbacks.name == "SUPA device synchronization"
    calls = []
    _gpu_trace.register_callback_for_device_synchronization(lambda: calls.append(1))
    try:
        torch.supa.synchronize()
    finally:
        _gpu_trace.DeviceSynchronizationCallbacks.callback_list.clear()
    assert calls


@pytest.mark.slow  # a fresh interpreter: PyTorch's GPU trace, once on, stays on for the process
def test_gpu_trace_reports_event_lifetimes_and_memory_blocks(python_subprocess):
    """The callbacks that only the native runtime can fire (as CUDA's allocator and guard fire them)."""
    result = python_subprocess("""
        import gc, json, torch
        from torch.supa import _gpu_trace
        seen = {name: [] for name in ("created", "deleted", "allocated", "freed")}
        _gpu_trace.register_callback_for_event_creation(seen["created"].append)
        _gpu_trace.register_callback_for_event_deletion(seen["deleted"].append)
        _gpu_trace.register_callback_for_memory_allocation(seen["allocated"].append)
        _gpu_trace.register_callback_for_memory_deallocation(seen["freed"].append)
        x = torch.empty(1000, device="supa")
        address = x.data_ptr()
        del x
        event = torch.supa.Event()
        event.record()
        del event
        gc.collect()
        print(json.dumps({"address": address, **seen}))
    """)
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["address"] in seen["allocated"] and seen["address"] in seen["freed"]
    assert len(seen["created"]) == 1 and seen["deleted"] == seen["created"]
