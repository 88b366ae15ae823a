"""torch.supa's public surface: every name of `torch.supa.__all__` has a behaviour check here."""

import multiprocessing.reduction
import os
import pickle
import select
import signal
import warnings

import pytest
import torch

supa = pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

from conftest import behaviour_table

pytestmark = pytest.mark.usefixtures("restore_supa_device")

REAL_PACKAGE_NAME_COUNT = 103  # len(torch_supa.supa.__all__) of the real package
MiB = 1 << 20

CHECKS, check = behaviour_table()


def _block_allocated(address):
    return any(block["address"] == address and block["state"] == "active_allocated"
               for seg in torch.supa.memory_snapshot() for block in seg["blocks"])


def _segment_of(address):
    return next(seg for seg in torch.supa.memory_snapshot()
                if seg["address"] <= address < seg["address"] + seg["total_size"])


# ---------------------------------------------------------------------------------------------
# Legacy tensor types and storages: torch's CPU classes of the same names are the reference.

_TENSOR_TYPES = [name for name in dir(torch.supa) if name.endswith("Tensor") and name in torch.supa.__all__]
_STORAGE_TYPES = [name for name in dir(torch.supa) if name.endswith("Storage") and name in torch.supa.__all__]


@check(*_TENSOR_TYPES)
def _legacy_tensor_type(name):
    cls, cpu_cls = getattr(torch.supa, name), getattr(torch, name)
    assert cls.dtype == cpu_cls.dtype and cls.is_supa
    if cls.dtype == torch.float64:
        with pytest.raises(RuntimeError, match="does not support double"):
            cls([1, 0])
        return
    made = cls([1, 0])
    assert isinstance(made, cls) and made.device.type == "supa"
    assert torch.equal(made.cpu(), cpu_cls([1, 0]))
    assert not isinstance(cpu_cls([1, 0]), cls)


@check(*_STORAGE_TYPES)
def _legacy_storage_type(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        storage = getattr(torch.supa, name)(3)
        assert storage.device.type == "supa" and storage.size() == 3
        assert storage.dtype == getattr(torch, name)(3).dtype


# ---------------------------------------------------------------------------------------------
# Initialisation and devices

@check("_is_compiled")
def _compiled(name):
    assert torch.supa._is_compiled() is True
    assert torch.supa._native()._device_count() == torch.supa.device_count()


def _run_in_fork(child, timeout=60):
    """The bytes `child()` returns, computed in a child forked from this (initialised) process.

    The child only runs small ops: an OpenMP pool the parent started does not survive fork.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write_end, child())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child did not answer")
        return os.read(read_end, 256)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


@check("_is_in_bad_fork")
def _forked_child_keeps_the_cards(name):
    # torch.cuda would call the child a bad fork; the real SUPA stack registers no fork hook.
    def child():
        usable = torch.supa.is_initialized() and torch.ones(4, device="supa").sum().item() == 4
        return repr((torch.supa._is_in_bad_fork(), usable)).encode()

    assert _run_in_fork(child) == b"(False, True)"
    assert torch.supa._is_in_bad_fork() is False


@check("_lazy_call")
def _lazy_call_once_initialised(name):
    seen = []
    torch.supa._lazy_call(lambda: seen.append("now"))
    torch.supa._lazy_call(lambda: seen.append("seed"), seed=True)
    assert seen == ["now", "seed"]
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['later'\]"):
        torch.supa._lazy_call(lambda: seen.append("never"), later=True)
    assert seen == ["now", "seed"]


@check("_lazy_init", "init", "is_initialized", "default_generators")
def _initialised(name):
    torch.supa._lazy_init()
    torch.supa.init()
    assert torch.supa.is_initialized() and torch.supa._initialized
    assert [g.device for g in torch.supa.default_generators] == [
        torch.device("supa", i) for i in range(torch.supa.device_count())]


@check("_sleep")
def _sleep_for_cycles(name):
    clock_hz = torch.supa.get_device_properties().clock_rate * 1000
    stream = torch.supa.Stream()
    with torch.supa.stream(stream):
        torch.supa._sleep(clock_hz // 10)  # a tenth of a second of the card's clock
    assert stream.query() is False  # busy, while the host went on (test_streams.py has the rest)
    stream.synchronize()
    assert stream.query() is True
    with pytest.raises(RuntimeError, match="expected 'int'"):
        torch.supa._sleep(1.5)


@check("is_available", "device_count")
def _count(name):
    assert torch.supa.is_available()
    assert torch.supa.device_count() == torch.accelerator.device_count() >= 1


@check("current_device", "set_device")
def _select(name):
    last = torch.supa.device_count() - 1
    torch.supa.set_device(last)
    assert torch.supa.current_device() == last
    assert torch.empty(1, device="supa").device == torch.device("supa", last)
    torch.supa.set_device(-1)  # negative: ignored
    assert torch.supa.current_device() == last


@check("device")
def _device_context(name):
    last = torch.supa.device_count() - 1
    torch.supa.set_device(0)
    with torch.supa.device(last):
        assert torch.supa.current_device() == last
    with torch.supa.device(-1):
        assert torch.supa.current_device() == 0
    assert torch.supa.current_device() == 0


@check("can_device_access_peer")
def _peer_access(name):
    n = torch.supa.device_count()
    assert torch.supa.can_device_access_peer(0, 0) is False
    assert torch.supa.can_device_access_peer(0, n - 1) is (n > 1)
    with pytest.raises(AssertionError, match="Invalid peer device id"):
        torch.supa.can_device_access_peer(0, n)


@check("check_error", "supart")
def _runtime_api(name):
    rt = torch.supa.supart()
    assert rt.supaMemGetInfo(0) == torch.supa.mem_get_info(0)
    assert torch.supa.check_error(rt.supaError.success) is None
    with pytest.raises(RuntimeError, match=r"\(7\)"):
        torch.supa.check_error(7)
    with pytest.raises(NotImplementedError, match="torch.supa.Stream"):
        rt.supaStreamCreate(0)


@check("current_blas_handle")
def _blas_handle_per_device(name):
    handles = []
    for index in range(torch.supa.device_count()):
        with torch.supa.device(index):
            handles.append(torch.supa.current_blas_handle())
            assert torch.supa.current_blas_handle() == handles[-1]  # stable
    assert all(handles) and len(set(handles)) == len(handles)  # non-zero, one per device


@check("get_device_name", "get_device_properties")
def _properties(name):
    props = torch.supa.get_device_properties(0)
    assert torch.supa.get_device_name(0) == props.name
    assert props.total_memory == torch.supa.mem_get_info(0)[1]
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.supa.get_device_properties(torch.supa.device_count())


@check("is_bf16_supported")
def _bf16(name):
    assert torch.supa.is_bf16_supported() is True
    assert torch.supa.is_bf16_supported(including_emulation=False) is False


@check("synchronize")
def _synchronize(name):
    fired = []
    torch.supa._gpu_trace.register_callback_for_device_synchronization(lambda: fired.append(1))
    try:
        torch.supa.synchronize(0)
    finally:
        torch.supa._gpu_trace.DeviceSynchronizationCallbacks.callback_list.pop()
    assert fired == [1]


# ---------------------------------------------------------------------------------------------
# Streams, events, graphs

@check("Stream", "current_stream", "default_stream", "set_stream", "stream", "StreamContext")
def _streams(name):
    default = torch.supa.default_stream()
    assert default.supa_stream == 0 and torch.supa.current_stream() == default
    side = torch.supa.Stream()
    assert side != default and side.device == torch.device("supa", torch.supa.current_device())
    with torch.supa.stream(side):
        assert torch.supa.current_stream() == side
    with torch.supa.StreamContext(side):
        assert torch.supa.current_stream() == side
    assert torch.supa.current_stream() == default
    torch.supa.set_stream(side)
    try:
        assert torch.supa.current_stream() == side
    finally:
        torch.supa.set_stream(default)


@check("ExternalStream")
def _external_stream(name):
    side = torch.supa.Stream()
    external = torch.supa.ExternalStream(side.supa_stream)
    assert external == side
    with torch.supa.stream(external):
        assert torch.supa.current_stream().supa_stream == side.supa_stream


@check("Event")
def _events(name):
    start, end = torch.supa.Event(enable_timing=True), torch.supa.Event(enable_timing=True)
    start.record()
    torch.ones(8, device="supa").sum()
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0


@check("SUPAGraph", "graph", "is_current_stream_capturing")
def _graph_capture_and_replay(name):
    x = torch.ones(4, device="supa")
    g = torch.supa.SUPAGraph()
    capturing = []
    with torch.supa.graph(g):
        capturing.append(torch.supa.is_current_stream_capturing())
        y = x * 2
    assert capturing == [True] and not torch.supa.is_current_stream_capturing()
    x.fill_(5)
    g.replay()
    assert torch.equal(y.cpu(), torch.full((4,), 10.0))


@check("graph_pool_handle")
def _graph_pool(name):
    first, second = torch.supa.graph_pool_handle(), torch.supa.graph_pool_handle()
    assert first[1] == second[1] == 0 and second[0] > first[0] > 0


@check("make_graphed_callables")
def _graphed_callable(name):
    w = torch.randn(3, 2, device="supa")
    graphed = torch.supa.make_graphed_callables(lambda inp: inp @ w, (torch.randn(4, 3, device="supa"),),
                                                num_warmup_iters=1)
    x = torch.randn(4, 3, device="supa")
    torch.testing.assert_close(graphed(x).cpu(), x.cpu() @ w.cpu())


# ---------------------------------------------------------------------------------------------
# Memory

@check("caching_allocator_alloc", "caching_allocator_delete")
def _raw_allocation(name):
    before = torch.supa.memory_allocated()
    address = torch.supa.caching_allocator_alloc(MiB)
    try:
        assert torch.supa.memory_allocated() - before >= MiB
        assert _segment_of(address)["device"] == torch.supa.current_device()
    finally:
        torch.supa.caching_allocator_delete(address)
    assert torch.supa.memory_allocated() == before
    with pytest.raises(TypeError, match="Invalid type for stream argument"):
        torch.supa.caching_allocator_alloc(MiB, stream="side")


@check("caching_allocator_enable")
def _caching_always_on(name):
    with pytest.warns(UserWarning, match="not modelled"):
        torch.supa.caching_allocator_enable(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.supa.caching_allocator_enable(True)
    block = torch.empty(MiB, dtype=torch.uint8, device="supa")
    reserved = torch.supa.memory_reserved()
    del block
    assert torch.supa.memory_reserved() == reserved  # the freed block stays cached


@check("SUPAPluggableAllocator", "change_current_allocator", "get_allocator_backend")
def _allocator_is_fixed(name):
    assert torch.supa.get_allocator_backend() == "native"
    with pytest.raises(NotImplementedError):
        torch.supa.SUPAPluggableAllocator("liballoc.so", "alloc", "free")
    with pytest.raises(NotImplementedError):
        torch.supa.change_current_allocator(None)


@check("empty_cache", "memory_reserved", "max_memory_reserved", "memory_cached", "max_memory_cached")
def _cache_release(name):
    torch.supa.empty_cache()
    base = torch.supa.memory_reserved()
    block = torch.empty(4 * MiB, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_reserved() >= base + 4 * MiB
    assert torch.supa.max_memory_reserved() >= torch.supa.memory_reserved()
    with pytest.warns(FutureWarning):
        assert torch.supa.memory_cached() == torch.supa.memory_reserved()
    with pytest.warns(FutureWarning):
        assert torch.supa.max_memory_cached() == torch.supa.max_memory_reserved()
    del block
    torch.supa.empty_cache()
    assert torch.supa.memory_reserved() <= base  # (other tests' garbage may have gone too)


@check("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "reset_max_memory_allocated",
       "reset_max_memory_cached")
def _allocated_and_peaks(name):
    base = torch.supa.memory_allocated()
    block = torch.empty(2 * MiB, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - base >= 2 * MiB
    del block
    assert torch.supa.max_memory_allocated() >= base + 2 * MiB
    torch.supa.reset_peak_memory_stats()
    assert torch.supa.max_memory_allocated() < base + 2 * MiB  # the peak starts again from now
    for deprecated in (torch.supa.reset_max_memory_allocated, torch.supa.reset_max_memory_cached):
        with pytest.warns(FutureWarning, match="resets /all/ peak memory stats"):
            deprecated()


@check("memory_stats", "memory_stats_as_nested_dict", "reset_accumulated_memory_stats")
def _statistics(name):
    nested = torch.supa.memory_stats_as_nested_dict()
    flat = torch.supa.memory_stats()
    assert flat["allocated_bytes.all.current"] == nested["allocated_bytes"]["all"]["current"]
    assert list(flat) == sorted(flat)
    torch.empty(MiB, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_stats()["allocation.all.allocated"] >= 1
    torch.supa.reset_accumulated_memory_stats()
    assert torch.supa.memory_stats()["allocation.all.allocated"] == 0


@check("memory_summary")
def _summary(name):
    summary = torch.supa.memory_summary(0)
    assert "device ID 0" in summary and "Allocated memory" in summary
    assert "from large pool" not in torch.supa.memory_summary(0, abbreviated=True)


@check("memory_snapshot")
def _snapshot(name):
    block = torch.empty(MiB, dtype=torch.uint8, device="supa")
    segment = _segment_of(block.data_ptr())
    assert segment["device"] == block.device.index and segment["allocated_size"] >= MiB


@check("mem_get_info")
def _free_memory(name):
    free, total = torch.supa.mem_get_info()
    assert 0 <= free <= total == torch.supa.get_device_properties().total_memory
    block = torch.empty(8 * MiB, dtype=torch.uint8, device="supa")
    assert torch.supa.mem_get_info()[0] <= free - 8 * MiB
    del block


@check("get_per_process_memory_fraction", "set_per_process_memory_fraction")
def _fraction(name):
    assert torch.supa.get_per_process_memory_fraction() == 1.0
    torch.supa.set_per_process_memory_fraction(0.5)
    try:
        assert torch.supa.get_per_process_memory_fraction() == 0.5
        with pytest.raises(TypeError, match="must be `float`"):
            torch.supa.set_per_process_memory_fraction(1)
    finally:
        torch.supa.set_per_process_memory_fraction(1.0)


@check("ipc_collect")
def _ipc_collect(name):
    # A receiver in this process: clearing torch's cache of received storages makes the
    # unpickling open the sender's memory as another process would.
    from torch.multiprocessing import reductions

    sent = torch.ones(1024, device="supa:0")
    address = sent.data_ptr()
    message = multiprocessing.reduction.ForkingPickler.dumps(sent)
    reductions.shared_cache.clear()
    received = pickle.loads(message)
    assert received.data_ptr() != address and received.tolist() == [1.0] * 1024
    del sent
    torch.supa.ipc_collect()
    assert _block_allocated(address)  # the receiver still holds it
    del received
    assert _block_allocated(address)  # released, not yet collected
    torch.supa.ipc_collect()
    assert not _block_allocated(address)


@check("MemPool", "use_mem_pool")
def _pools(name):
    pool = torch.supa.MemPool()
    assert pool.id[0] == 0 and pool.id[1] > 0
    with torch.supa.use_mem_pool(pool):
        inside = torch.empty(MiB, dtype=torch.uint8, device="supa")
    outside = torch.empty(MiB, dtype=torch.uint8, device="supa")
    assert tuple(_segment_of(inside.data_ptr())["segment_pool_id"]) == pool.id
    assert tuple(_segment_of(outside.data_ptr())["segment_pool_id"]) == (0, 0)


@check("MemPoolContext")
def _active_pool(name):
    pool = torch.supa.MemPool()
    assert torch.supa.MemPoolContext.active_pool() is None
    with torch.supa.MemPoolContext(pool):
        assert torch.supa.MemPoolContext.active_pool() is pool
    assert torch.supa.MemPoolContext.active_pool() is None


# ---------------------------------------------------------------------------------------------
# Random numbers

@check("manual_seed", "initial_seed", "random")
def _seed_current(name):
    torch.supa.manual_seed(11)
    first = torch.rand(4, device="supa")
    torch.supa.random.manual_seed(11)
    assert torch.equal(torch.rand(4, device="supa").cpu(), first.cpu())
    assert torch.supa.initial_seed() == 11


@check("manual_seed_all")
def _seed_all_devices(name):
    torch.supa.manual_seed_all(5)
    assert [g.initial_seed() for g in torch.supa.default_generators] == [5] * torch.supa.device_count()


@check("seed", "seed_all")
def _random_seeds(name):
    torch.supa.manual_seed_all(5)
    torch.supa.seed()
    assert torch.supa.initial_seed() != 5
    torch.supa.seed_all()
    seeds = {g.initial_seed() for g in torch.supa.default_generators}
    assert len(seeds) == 1 and seeds != {5}


@check("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all")
def _rng_state(name):
    state, states = torch.supa.get_rng_state(), torch.supa.get_rng_state_all()
    assert state.dtype == torch.uint8 and len(states) == torch.supa.device_count()
    first = torch.rand(4, device="supa")
    torch.supa.set_rng_state(state)
    assert torch.equal(torch.rand(4, device="supa").cpu(), first.cpu())
    torch.supa.set_rng_state_all(states)
    assert torch.equal(torch.rand(4, device="supa").cpu(), first.cpu())


# ---------------------------------------------------------------------------------------------
# Autocast and the submodules

@check("amp", "get_autocast_dtype", "set_autocast_dtype", "is_autocast_enabled", "set_autocast_enabled")
def _autocast(name):
    a, b = torch.randn(4, 4, device="supa"), torch.randn(4, 4, device="supa")
    assert torch.supa.get_autocast_dtype() == torch.float16
    with torch.supa.amp.autocast():
        assert torch.supa.is_autocast_enabled()
        assert (a @ b).dtype == torch.float16
    assert not torch.supa.is_autocast_enabled()
    torch.supa.set_autocast_dtype(torch.bfloat16)
    torch.supa.set_autocast_enabled(True)
    try:
        assert (a @ b).dtype == torch.bfloat16
    finally:
        torch.supa.set_autocast_enabled(False)
        torch.supa.set_autocast_dtype(torch.float16)


@check("get_amp_supported_dtype")
def _amp_dtypes(name):
    assert torch.supa.get_amp_supported_dtype() == [torch.bfloat16, torch.float16, torch.float32]


@check("bccl")
def _bccl(name):
    assert torch.supa.bccl.is_available([torch.ones(4, 4, device="supa").t()]) is False  # non-contiguous
    with pytest.raises(TypeError, match="Inputs should be a collection of tensors"):
        torch.supa.bccl.all_reduce(torch.ones(2, device="supa"))


@check("brtx")
def _brtx(name):
    with torch.profiler.profile() as prof:
        depth = torch.supa.brtx.range_push("surface-range")
        assert torch.supa.brtx.range_pop() == depth
    assert any(event.name == "surface-range" for event in prof.events())


@check("profiler")
def _device_profiler(name):
    assert not torch.supa.profiler.is_active()
    with torch.supa.profiler.profile():
        assert torch.supa.profiler.is_active()
    assert not torch.supa.profiler.is_active()


# ---------------------------------------------------------------------------------------------

def test_all_holds_the_real_packages_number_of_names_without_repeats():
    assert len(torch.supa.__all__) == len(set(torch.supa.__all__)) == REAL_PACKAGE_NAME_COUNT


def test_every_check_is_for_a_name_in_all():
    assert sorted(set(CHECKS) - set(torch.supa.__all__)) == []


@pytest.mark.parametrize("name", sorted(torch.supa.__all__))
def test_name_behaves(name):
    assert name in CHECKS, f"no behaviour check for torch.supa.{name}"
    CHECKS[name](name)


def test_submodule_all_lists_hold_no_private_names():
    for module in (torch.supa.memory, torch.supa.random, torch.supa.streams, torch.supa.graphs,
                   torch.supa.tensor_types, torch.supa.amp, torch.supa.brtx, torch.supa.profiler,
                   torch.supa.bccl):
        assert [n for n in module.__all__ if n.startswith("_")] == [], module.__name__


def test_names_outside_all_that_callers_use():
    for name in ("set_stream_by_id", "get_device_capability", "_get_device_index", "_exchange_device",
                 "_maybe_exchange_device", "_DeviceGuard", "autocast", "custom_fwd", "custom_bwd",
                 "get_autocast_gpu_dtype", "_set_allocator_settings", "_record_memory_history", "_snapshot"):
        assert hasattr(torch.supa, name), name


def test_module_getattr_serves_initialized_and_rejects_unknown_names():
    assert torch.supa._initialized is torch.supa.is_initialized()
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        torch.supa.no_such_thing
