"""torch.supa device management: enumeration, selection, properties, lazy init, module surface."""

import re
import threading

import pytest

from harness import ANY, PRISTINE, fresh_process
import torch

supa = pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

PROPERTY_FIELDS = {
    "name", "major", "minor", "is_multi_gpu_board", "is_integrated", "multi_processor_count",
    "total_memory", "max_threads_per_multi_processor", "max_threads_per_block", "warp_size",
    "shared_memory_per_block", "clock_rate", "memory_clock_rate", "memory_bus_width",
    "shared_memory_per_block_optin", "shared_memory_per_multiprocessor", "regs_per_multiprocessor",
    "gcnArchName", "uuid", "pci_bus_id", "pci_device_id", "pci_domain_id", "L2_cache_size",
}

multi_device = pytest.mark.skipif(torch.supa.device_count() < 2, reason="needs two SUPA devices")


pytestmark = pytest.mark.usefixtures("restore_supa_device")


def test_module_is_registered_as_torch_supa():
    assert torch.supa is supa
    assert torch.accelerator.current_accelerator().type == "supa"


def test_availability_and_count():
    assert torch.supa.is_available()
    assert torch.supa.device_count() >= 1
    assert torch.supa.device_count() == torch.accelerator.device_count()
    assert torch.supa._is_compiled()


def test_initialised_state_and_generators():
    torch.supa.init()
    assert torch.supa.is_initialized()
    assert len(torch.supa.default_generators) == torch.supa.device_count()
    for i, gen in enumerate(torch.supa.default_generators):
        assert gen.device == torch.device("supa", i)


def _seeds_queued_before_init() -> list:
    """In a fresh interpreter: seeds set before initialisation, then init; the generators' seeds."""
    assert torch.supa.is_initialized() is False
    assert torch.supa.default_generators == ()
    torch.supa.manual_seed_all(1)   # replaced by the later manual_seed_all
    torch.supa.manual_seed_all(3)
    torch.supa.seed_all()           # random seeds, queued in order
    torch.supa.manual_seed(5)
    torch.supa.seed()               # random seed, queued in order
    assert torch.supa.is_initialized() is False
    torch.supa.init()
    return [g.initial_seed() for g in torch.supa.default_generators]


_QUEUED_SEEDS = fresh_process(_seeds_queued_before_init, shared=PRISTINE)


def test_lazy_init_in_fresh_process_runs_queued_seeds_last():
    """Before initialisation only the latest manual_seed / manual_seed_all call is kept, and
    those run after every other queued call, in the order they were last made (as torch.cuda)."""
    # seed_all() and seed() run first; then manual_seed_all(3) and manual_seed(5), in the
    # order they were last called: 3 everywhere, then 5 on the current device (0).
    assert _QUEUED_SEEDS.result().value == [5] + [3] * (torch.supa.device_count() - 1)


def _init_without_devices() -> None:
    assert torch.supa.device_count() == 0
    assert torch.supa.is_available() is False
    with pytest.raises(RuntimeError, match="^No BIREN GPUs are available$"):
        torch.supa.init()


_INIT_WITHOUT_DEVICES = fresh_process(_init_without_devices, env={"SUPA_VISIBLE_DEVICES": ""}, shared=ANY)


@pytest.mark.emulation_only
def test_init_without_devices_raises():
    _INIT_WITHOUT_DEVICES.result()


def test_set_device_and_current_device():
    torch.supa.set_device(0)
    assert torch.supa.current_device() == 0
    torch.supa.set_device(-1)  # negative: silently ignored
    assert torch.supa.current_device() == 0
    torch.supa.set_device("supa:0")
    assert torch.supa.current_device() == 0


@pytest.mark.parametrize("index", [1 << 8, 1 << 20, (1 << 31) - 1])
def test_device_indices_too_wide_for_a_device_index_are_refused_not_wrapped(index):
    # PyTorch keeps device indices in 8 bits: narrowed unchecked, 1 << 8 would be device 0.
    before = torch.supa.current_device()
    for call in (torch.supa.set_device, torch.supa.synchronize, torch.supa.get_per_process_memory_fraction):
        with pytest.raises(torch.AcceleratorError, match=rf"SUPA error: invalid device ordinal \(device {index},"):
            call(index)
    assert torch.supa.current_device() == before


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
    from supa_emu import process_state

    cfg = process_state.config()
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


def _gpu_trace_of_a_tensor_and_an_event() -> dict:
    """In a fresh interpreter: what the GPU trace's callbacks saw of a tensor and an event."""
    import gc

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
    return {"address": address, **seen}


@pytest.mark.slow  # a fresh interpreter: PyTorch's GPU trace, once on, stays on for the process
def test_gpu_trace_reports_event_lifetimes_and_memory_blocks():
    """The callbacks that only the native runtime can fire (as CUDA's allocator and guard fire them)."""
    seen = fresh_process(_gpu_trace_of_a_tensor_and_an_event).value
    assert seen["address"] in seen["allocated"] and seen["address"] in seen["freed"]
    assert len(seen["created"]) == 1 and seen["deleted"] == seen["created"]
