"""SUPA_Accelerator answers every method of DeepSpeed's accelerator interface (how DeepSpeed selects it:
test_accelerator_selection.py).

Written against public APIs (`get_accelerator()`, `torch.supa`), so it runs on a real card as well
as under `SUPA_EMULATE=1`.
"""

import sys
import warnings

import pytest
import torch

from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

from supa_deepspeed import accelerator
from supa_deepspeed.accelerator.supa_accelerator import SUPA_Accelerator

from conftest import behaviour_table


MiB = 1 << 20

# The interface's abstract methods, in the interface's own order, plus the concrete methods
# whose SUPA answer differs from the base class or that DeepSpeed's SUPA support relies on.
INTERFACE = [name for name in DeepSpeedAccelerator.__dict__ if name in DeepSpeedAccelerator.__abstractmethods__]
EXTRAS = ["is_fp64_supported", "is_current_stream_capturing", "pin_memory", "is_pinned",
          "communication_backend_version"]

requires_supa = pytest.mark.skipif(not SUPA_Accelerator().is_available(),
                                   reason="no SUPA device: run on a SUPA card or with SUPA_EMULATE=1")


@pytest.fixture
def accel():
    return SUPA_Accelerator()


# ---------------------------------------------------------------------------------------------
# Shape of the class


def test_interface_is_nonempty_and_class_is_concrete():
    assert len(INTERFACE) == len(DeepSpeedAccelerator.__abstractmethods__) > 0
    assert not SUPA_Accelerator.__abstractmethods__
    assert isinstance(SUPA_Accelerator(), DeepSpeedAccelerator)


def test_every_abstract_method_is_defined_in_the_interface_order():
    own = list(SUPA_Accelerator.__dict__)
    missing = [name for name in INTERFACE if name not in own]
    assert not missing
    positions = [own.index(name) for name in INTERFACE]
    assert positions == sorted(positions)


def test_package_import_is_free_and_offers_no_deepspeed_names():
    # DeepSpeed probes `accelerator.abstract_accelerator` and `from accelerator import get_accelerator`
    # to detect its own source tree; this package must answer no to both.
    assert not hasattr(accelerator, "get_accelerator")
    assert not hasattr(accelerator, "abstract_accelerator")
    assert accelerator.SUPA_Accelerator is SUPA_Accelerator


# ---------------------------------------------------------------------------------------------
# Every interface method answers sensibly

CHECKS, check = behaviour_table()


@check("is_synchronized_device", "use_host_timers", "resolves_data_dependency", "handles_memory_backpressure")
def _synchronization(a):
    assert a.is_synchronized_device() is False
    assert a.use_host_timers() is a.resolves_data_dependency() is a.handles_memory_backpressure() is False


@check("device_name", "device")
def _device_names(a):
    assert a.device_name() == "supa"
    assert a.device_name(1) == "supa:1"
    assert a.device(0) == torch.device("supa", 0)
    assert a.device() == torch.device("supa")


@check("set_device", "current_device", "current_device_name")
def _current_device(a):
    before = a.current_device()
    last = a.device_count() - 1
    try:
        a.set_device(last)
        assert a.current_device() == last
        assert a.current_device_name() == f"supa:{last}"
        assert torch.empty(1, device=a.device()).device == torch.device("supa", last)
    finally:
        a.set_device(before)
    assert a.current_device() == before


@check("device_count")
def _device_count(a):
    assert a.device_count() == torch.supa.device_count() >= 1


@check("synchronize")
def _synchronize(a):
    x = torch.ones(4, device="supa:0") * 2
    assert a.synchronize() is None
    assert a.synchronize(0) is None
    assert x.sum().item() == 8


@check("random")
def _random(a):
    assert a.random() is torch.random


@check("get_rng_state", "set_rng_state")
def _rng_state(a):
    state = a.get_rng_state(0)
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    first = torch.randn(8, device="supa:0")
    a.set_rng_state(state, 0)
    assert torch.equal(torch.randn(8, device="supa:0"), first)
    state = a.get_rng_state()  # current device
    first = torch.randn(8, device=a.device())
    a.set_rng_state(state)
    assert torch.equal(torch.randn(8, device=a.device()), first)


@check("manual_seed", "initial_seed")
def _manual_seed(a):
    a.manual_seed(1234)
    assert a.initial_seed() == 1234
    first = torch.randn(8, device=a.device())
    a.manual_seed(1234)
    assert torch.equal(torch.randn(8, device=a.device()), first)


@check("manual_seed_all")
def _manual_seed_all(a):
    devices = [a.device(i) for i in range(min(2, a.device_count()))]
    a.manual_seed_all(99)
    first = [torch.rand(4, device=d) for d in devices]
    a.manual_seed_all(99)
    assert all(torch.equal(torch.rand(4, device=d), f) for d, f in zip(devices, first))


@check("default_generator")
def _default_generator(a):
    generator = a.default_generator(0)
    assert isinstance(generator, torch.Generator)
    assert generator.device == torch.device("supa", 0)
    generator.manual_seed(5)
    first = torch.rand(4, device="supa:0", generator=generator)
    generator.manual_seed(5)
    assert torch.equal(torch.rand(4, device="supa:0", generator=generator), first)


@check("Stream", "stream", "current_stream", "default_stream")
def _streams(a):
    side = a.Stream()
    assert isinstance(side, torch.Stream) and side.device.type == "supa"
    assert a.current_stream() == a.default_stream()
    with a.stream(side):
        assert a.current_stream() == side
        y = torch.ones(3, device=a.device()) + 1
    a.current_stream().wait_stream(side)
    assert a.current_stream() == a.default_stream()
    assert y.sum().item() == 6
    assert a.default_stream(0).device == torch.device("supa", 0)


@check("Event")
def _events(a):
    start, end = a.Event(enable_timing=True), a.Event(enable_timing=True)
    start.record()
    torch.ones(1000, device=a.device()).sum()
    end.record()
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 0


@check("empty_cache", "memory_allocated", "max_memory_allocated", "reset_max_memory_allocated", "memory_cached",
       "max_memory_cached", "reset_max_memory_cached", "memory_stats", "reset_peak_memory_stats", "memory_reserved",
       "max_memory_reserved")
def _memory_counters(a):
    base = a.memory_allocated(0)
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="supa:0")
    assert a.memory_allocated(0) >= base + 4 * MiB
    assert a.memory_stats(0)["allocated_bytes.all.current"] == a.memory_allocated(0)
    assert a.max_memory_allocated(0) >= a.memory_allocated(0)
    assert a.memory_reserved(0) >= a.memory_allocated(0)
    assert a.memory_cached(0) == a.memory_reserved(0)
    assert a.max_memory_reserved(0) >= a.memory_reserved(0)
    assert a.max_memory_cached(0) == a.max_memory_reserved(0)
    del x
    assert a.memory_allocated(0) == base
    assert a.max_memory_allocated(0) >= base + 4 * MiB
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a.reset_max_memory_allocated(0)
        assert a.max_memory_allocated(0) == a.memory_allocated(0)
        a.reset_max_memory_cached(0)
        assert a.max_memory_cached(0) == a.memory_cached(0)
        a.memory_cached(0)
    # The deprecated torch.supa aliases warn on every call; DeepSpeed calls these constantly.
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    y = torch.empty(4 * MiB, dtype=torch.uint8, device="supa:0")
    del y
    a.reset_peak_memory_stats(0)
    assert a.max_memory_allocated(0) == a.memory_allocated(0)
    a.empty_cache()
    assert a.memory_reserved(0) <= a.memory_stats(0)["reserved_bytes.all.peak"]


@check("total_memory", "available_memory")
def _memory_sizes(a):
    total = a.total_memory(0)
    assert total == torch.supa.get_device_properties(0).total_memory > 0
    assert a.total_memory() == a.total_memory(a.current_device())
    assert 0 < a.available_memory(0) <= total


@check("is_bf16_supported", "is_fp16_supported", "is_fp64_supported", "supported_dtypes")
def _dtypes(a):
    probes = {torch.bfloat16: a.is_bf16_supported(), torch.float16: a.is_fp16_supported()}
    assert all(isinstance(v, bool) for v in probes.values())
    dtypes = a.supported_dtypes()
    assert dtypes[0] == torch.float32
    assert [d for d in (torch.float16, torch.bfloat16) if probes[d]] == dtypes[1:]
    for dtype in dtypes:
        assert (torch.ones(2, dtype=dtype, device=a.device()) * 2).sum().item() == 4
    fp64 = a.is_fp64_supported()
    assert isinstance(fp64, bool)
    if fp64:
        assert torch.ones(2, dtype=torch.float64).to(a.device()).dtype == torch.float64


@check("is_available")
def _available(a):
    assert a.is_available() is True


@check("range_push", "range_pop")
def _ranges(a):
    for _ in range(2):
        a.range_push("supa-accelerator-test")
        a.range_pop()
    a.range_push("with-domain", domain="ds", category=1)
    a.range_pop(domain="ds")


@check("lazy_call")
def _lazy_call(a):
    called = []
    a.lazy_call(lambda: called.append(True))
    torch.supa.init()
    assert called == [True]


@check("communication_backend_name")
def _backend(a):
    assert a.communication_backend_name() == ("bccl" if sys.platform != "win32" else "gloo")


@check("communication_backend_version")
def _backend_version(a):
    # BCCL's version tuple, as the CUDA accelerator answers with NCCL's: (major, minor, patch[, suffix]).
    version = a.communication_backend_version()
    assert version == torch.supa.bccl.version()
    assert isinstance(version, tuple) and len(version) in (3, 4) and all(isinstance(v, int) for v in version[:3])


@check("is_triton_supported")
def _triton(a):
    supported = a.is_triton_supported()
    assert isinstance(supported, bool)
    try:
        import triton  # noqa: F401
    except ImportError:
        assert supported is False


@check("create_graph", "capture_to_graph", "replay_graph", "is_current_stream_capturing")
def _graphs(a):
    static_in = torch.ones(4, device=a.device())
    assert a.is_current_stream_capturing() is False
    graph = a.create_graph()
    with a.capture_to_graph(graph):
        assert a.is_current_stream_capturing() is True
        static_out = static_in * 3
    assert a.is_current_stream_capturing() is False
    static_in.fill_(2)
    a.replay_graph(graph)
    assert static_out.tolist() == [6.0] * 4


TENSOR_TYPES = {
    "BFloat16Tensor": torch.bfloat16,
    "ByteTensor": torch.uint8,
    "DoubleTensor": torch.float64,
    "FloatTensor": torch.float32,
    "HalfTensor": torch.float16,
    "IntTensor": torch.int32,
    "LongTensor": torch.int64,
}


@check(*TENSOR_TYPES)
def _tensor_types(a):
    for name, dtype in TENSOR_TYPES.items():
        make = getattr(a, name)
        assert make.keywords["dtype"] == dtype
        if dtype == torch.float64 and not a.is_fp64_supported():
            continue  # the device refuses float64 data; is_fp64_supported says so
        t = make([1, 2])
        assert t.dtype == dtype and t.device.type == "supa"
        assert t.tolist() == [1, 2]


@check("pin_memory", "is_pinned")
def _pinning(a):
    host = torch.arange(8, dtype=torch.float32)
    assert not a.is_pinned(host)
    pinned = a.pin_memory(host)
    assert a.is_pinned(pinned) and torch.equal(pinned, host)
    scratch = a.pin_memory(host, make_copy=False)
    assert a.is_pinned(scratch) and scratch.shape == host.shape
    assert torch.equal(pinned.to(a.device(), non_blocking=True).cpu(), host)


@check("on_accelerator")
def _on_accelerator(a):
    assert a.on_accelerator(torch.ones(1, device=a.device()))
    assert not a.on_accelerator(torch.ones(1))


@check("op_builder_dir", "create_op_builder", "get_op_builder")
def _op_builders(a):
    assert a.op_builder_dir() == "supa_deepspeed.op_builder.supa"
    adam = a.get_op_builder("FusedAdamBuilder")
    assert adam.__name__ == "FusedAdamBuilder" and adam.__module__.startswith("supa_deepspeed.op_builder.supa.")
    assert type(a.create_op_builder("FusedAdamBuilder")) is adam
    # Base classes are not ops.
    assert a.get_op_builder("SUPAOpBuilder") is not getattr(sys.modules["supa_deepspeed.op_builder.supa.builder"], "SUPAOpBuilder")
    missing = a.create_op_builder("NoSuchKernelBuilder")
    if missing is not None:
        assert not missing.is_compatible()
        with pytest.raises(NotImplementedError, match="NoSuchKernelBuilder"):
            missing.load()


@check("build_extension")
def _build_extension(a):
    from torch.utils.cpp_extension import BuildExtension
    assert a.build_extension() is BuildExtension


@check("export_envs", "visible_devices_envs", "set_visible_devices_envs")
def _envs(a):
    assert a.export_envs() == ["BCCL", "BIREN", "SUPA", "LD_LIBRARY", "PATH"]
    assert a.visible_devices_envs() == ["SUPA_VISIBLE_DEVICES"]
    env = {}
    a.set_visible_devices_envs(env, [2, 0])
    assert env == {"SUPA_VISIBLE_DEVICES": "2,0"}


@check("get_compile_backend", "set_compile_backend")
def _compile_backend(a):
    assert a.get_compile_backend() == "inductor"
    a.set_compile_backend("eager")
    assert a.get_compile_backend() == "eager"
    with pytest.raises(ValueError, match="no_such_backend"):
        a.set_compile_backend("no_such_backend")
    assert a.get_compile_backend() == "eager"


@requires_supa
@pytest.mark.parametrize("name", INTERFACE + EXTRAS)
def test_interface_method_answers_sensibly(accel, name):
    assert name in CHECKS, f"no behaviour check for interface method {name}"
    CHECKS[name](accel)


@requires_supa
def test_deepspeeds_bf16_gate_opens(accel):
    """DeepSpeed's bf16 unit tests run only where `bf16_required_version_check()` (tests/unit/util.py)
    holds. With its build-time torch_info unset ('0.0', as pip-installed DeepSpeed has it) the gate
    reads at run time: torch >= 1.10, NCCL (`torch.cuda.nccl.version()`) >= 2.10, CUDA
    (`torch.version.cuda` when torch.cuda.is_available()) >= 11, and the accelerator's
    is_bf16_supported(). Under the transfer each of those names answers for the SUPA cards."""
    from deepspeed.git_version_info import torch_info

    def major_minor(text):
        return tuple(int(part) for part in text.split(".")[:2])

    if not (torch.cuda.is_available() and torch.cuda.device_count() == torch.supa.device_count()):
        pytest.skip("CUDA names do not mean the SUPA cards here (transfer_to_supa not applied)")
    torch_version = major_minor(torch_info["version"]) if torch_info["version"] != "0.0" else major_minor(torch.__version__)
    nccl = (major_minor(torch_info["nccl_version"]) if torch_info["nccl_version"] != "0.0"
            else tuple(torch.cuda.nccl.version()[:2]))
    cuda = major_minor(torch_info["cuda_version"]) if torch_info["cuda_version"] != "0.0" else major_minor(torch.version.cuda)
    assert torch_version >= (1, 10)
    assert nccl >= (2, 10), nccl
    assert cuda >= (11, 0), cuda
    assert accel.is_bf16_supported()
    assert tuple(accel.communication_backend_version()[:2]) == tuple(torch.cuda.nccl.version()[:2])


def test_pull_request_usage(accel):
    # As shown in DeepSpeed's SUPA pull request; selection itself is tested in fresh processes.
    if not accel.is_available():
        pytest.skip("no SUPA device")
    assert accel.device_name() == "supa"
    device = accel.device(0)
    assert device == torch.device("supa", 0)
    tensor = torch.randn(3, device=device)
    assert tensor.device == device and tensor.shape == (3, )


@requires_supa
def test_available_memory_is_what_the_device_can_still_hand_out(accel):
    accel.empty_cache()
    free_before = accel.available_memory(0)
    block = torch.empty(64 * MiB, dtype=torch.uint8, device="supa:0")
    free_in_use = accel.available_memory(0)
    assert free_in_use <= free_before - 64 * MiB
    allocated_in_use = accel.memory_allocated(0)
    del block
    # Freed but still cached by the allocator: not available to anyone else yet.
    assert accel.memory_allocated(0) <= allocated_in_use - 64 * MiB
    assert accel.available_memory(0) <= free_before - 64 * MiB
    assert accel.available_memory(0) < accel.total_memory(0) - accel.memory_allocated(0)
    accel.empty_cache()
    assert accel.available_memory(0) >= free_in_use + 64 * MiB
