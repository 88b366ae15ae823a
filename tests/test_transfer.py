"""transfer_to_supa: CUDA-named code addresses the SUPA cards (what `import torch` applies on a SUPA machine).

Most tests run in this process, where `import torch` applied the transfer as the real autoload
does; they only use public names, so they hold on a real SUPA machine too. The switches of the
transfer itself (autoload, `import torch_supa` first, SUPA_EMU_TRANSFER, the banner) run in fresh
processes.
"""

import io
import json
import pathlib
import zipfile

import pytest
import torch
import torch.distributed as dist

from harness import ANY, PORT, free_port, fresh_process, print_line, run_as_main, torchrun_command

ROOT = pathlib.Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    not (hasattr(torch, "supa") and torch.supa.is_available() and torch.cuda.is_available()),
    reason="needs SUPA cards with transfer_to_supa applied (real, or emulated with SUPA_EMULATE=1)")


# ---- device strings -------------------------------------------------------------------------

@pytest.mark.parametrize("text, index", [("cuda", None), ("cuda:0", 0), ("cuda:1", 1)])
def test_cuda_device_strings_mean_supa(text, index):
    device = torch.device(text)
    assert (device.type, device.index) == ("supa", index)
    assert str(device) == text.replace("cuda", "supa")
    assert torch.device("cuda", 1) == torch.device("supa", 1)


def test_tensors_created_and_moved_with_cuda_strings_land_on_supa():
    assert torch.randn(3, device="cuda").device == torch.device("supa", torch.supa.current_device())
    assert torch.zeros(2, device="cuda:1").device == torch.device("supa", 1)
    assert torch.ones(2).to("cuda:1").device == torch.device("supa", 1)
    assert torch.ones(2).to(device="cuda").device.type == "supa"
    assert torch.ones(2).cuda().device.type == "supa"
    assert torch.ones(2).cuda(1).device == torch.device("supa", 1)
    assert torch.Generator(device="cuda").device.type == "supa"


def test_is_cuda_is_true_for_supa_tensors_only():
    assert torch.ones(1, device="supa").is_cuda
    assert not torch.ones(1).is_cuda
    assert torch.nn.Parameter(torch.ones(1, device="supa")).is_cuda


def test_invalid_cuda_index_fails_like_the_supa_index():
    bad = torch.supa.device_count() + 3
    with pytest.raises(Exception) as via_cuda:
        torch.empty(1, device=f"cuda:{bad}")
    with pytest.raises(Exception) as via_supa:
        torch.empty(1, device=f"supa:{bad}")
    assert type(via_cuda.value) is type(via_supa.value)
    assert str(via_cuda.value) == str(via_supa.value)


def test_cuda_99_fails_where_supa_99_fails():
    """`torch.device` only parses; the first use of a card that does not exist fails, with the supa error."""
    assert torch.device("cuda:99") == torch.device("supa:99")
    errors = []
    for text in ("cuda:99", "supa:99"):
        with pytest.raises(Exception) as caught:
            torch.ones(1).to(torch.device(text))
        errors.append(caught.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert "99" in str(errors[0])


def test_other_device_strings_are_unchanged():
    assert torch.device("cpu").type == "cpu"
    assert torch.device("meta").type == "meta"
    with pytest.raises(RuntimeError, match="device string"):
        torch.device("cudaa")  # still rejected, spelled as the supa string it was rewritten to


# ---- modules and optimizers -----------------------------------------------------------------

def test_module_cuda_and_to_keep_parameter_objects():
    model = torch.nn.Linear(4, 3)
    before = list(model.parameters())
    model.cuda()
    assert all(a is b for a, b in zip(before, model.parameters()))
    assert all(p.device.type == "supa" for p in model.parameters())
    model.to("cuda:1")
    assert all(a is b for a, b in zip(before, model.parameters()))
    assert model.weight.device == torch.device("supa", 1)


@pytest.mark.parametrize("move", [lambda m: m.cuda(), lambda m: m.to("supa")], ids=["cuda", "to_supa"])
def test_optimizer_created_before_the_move_trains_the_moved_parameters(move):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.load_state_dict(reference.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    move(model)
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    for _ in range(3):
        for net, opt, inputs, target in ((model, optimizer, x.to("supa"), y.to("supa")),
                                         (reference, reference_optimizer, x, y)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(inputs), target).backward()
            opt.step()
    for trained, expected in zip(model.parameters(), reference.parameters()):
        assert trained.device.type == "supa"
        torch.testing.assert_close(trained.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)


def test_data_parallel_over_two_cards_matches_the_cpu_module():
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.load_state_dict(reference.state_dict())
    parallel = torch.nn.DataParallel(model.cuda(), device_ids=[0, 1])
    x = torch.randn(10, 4)
    out = parallel(x.cuda())
    expected = reference(x)
    assert out.device == torch.device("supa", 0)
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    for trained, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(trained.grad.cpu(), ref.grad, rtol=1e-5, atol=1e-6)


def test_torch_compile_of_a_cuda_written_model():
    from torch._dynamo.device_interface import get_interface_for_device

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model.load_state_dict(reference.state_dict())
    compiled = torch.compile(model.cuda())
    x = torch.randn(5, 8)
    out = compiled(x.cuda())
    assert out.device.type == "supa"
    torch.testing.assert_close(out.detach().cpu(), reference(x).detach(), rtol=1e-5, atol=1e-6)
    # Dynamo's questions about "cuda" devices are answered by the SUPA runtime.
    interface = get_interface_for_device("cuda")
    assert interface is get_interface_for_device("supa")
    assert interface.device_count() == torch.supa.device_count()


# ---- torch.cuda is the SUPA namespace -------------------------------------------------------

SPECIALLY_MAPPED = {"default_generators", "DoubleTensor"}


@pytest.mark.parametrize("name", sorted(set(torch.supa.__all__) - SPECIALLY_MAPPED) if hasattr(torch, "supa") else [])
def test_torch_cuda_names_are_supa_names(name):
    assert getattr(torch.cuda, name) is getattr(torch.supa, name)


def test_specially_mapped_names():
    assert torch.cuda.DoubleTensor is torch.supa.FloatTensor
    torch.supa.init()
    assert torch.cuda.default_generators == torch.supa.default_generators
    assert len(torch.cuda.default_generators) == torch.supa.device_count()
    assert torch.cuda.CUDAGraph is torch.supa.SUPAGraph
    assert torch.cuda.is_tf32_supported()
    # The pool entry points the real package maps onto torch._C (docs/real_stack.md).
    pool = torch.cuda.graph_pool_handle()
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, pool)
    try:
        x = torch.empty(8, device="cuda")
    finally:
        torch._C._cuda_endAllocateToPool(0, pool)
        torch._C._cuda_releasePool(0, pool)
    assert torch._C._cuda_checkPoolLiveAllocations(0, pool, {x.data_ptr()})


def test_transfer_copies_the_names_of_torch_supa_all_and_the_private_memory_names():
    from supa_emu.torch_supa.contrib import transfer_to_supa

    # Two lists kept apart on purpose (what torch.supa exports, what the transfer puts onto
    # torch.cuda); on the real stack they are the same 103 names.
    assert sorted(transfer_to_supa.CUDA_NAMES) == sorted(torch.supa.__all__)
    for name in ("_record_memory_history", "_snapshot", "_set_allocator_settings"):
        assert getattr(torch.cuda.memory, name) is getattr(torch.supa.memory, name)
    assert torch.cuda._get_device_index is not torch.supa._get_device_index  # unlisted: CUDA's own


def test_cuda_submodules_answer_for_supa():
    x = torch.ones(1024, device="cuda")
    assert torch.cuda.memory.memory_allocated() == torch.supa.memory_allocated() > 0
    assert torch.cuda.max_memory_allocated() == torch.supa.max_memory_allocated() >= x.numel() * 4
    torch.cuda.random.manual_seed(7)
    a = torch.randn(4, device="cuda")
    torch.supa.manual_seed(7)
    torch.testing.assert_close(a, torch.randn(4, device="supa"))
    assert torch.cuda.amp.autocast is torch.supa.amp.autocast
    assert torch.cuda.nvtx.range_push is torch.supa.brtx.range_push
    assert torch.cuda.nccl.is_available is torch.supa.bccl.is_available
    assert torch.cuda.current_stream().cuda_stream == torch.supa.current_stream().supa_stream


def test_cuda_streams_rebuilt_from_their_fields_are_the_supa_streams():
    # torch's test_cuda.py (test_generic_stream_event), and code that names CUDA's device type (1).
    generic = torch.Stream("cuda")
    assert generic.device_index == torch.cuda.current_device()
    for device_type in (generic.device_type, 1):
        rebuilt = torch.cuda.Stream(stream_id=generic.stream_id, device_index=generic.device_index,
                                    device_type=device_type)
        assert rebuilt == generic and rebuilt.device == torch.device("supa", generic.device_index)
    assert torch.cuda.Event(external=True).query()


def test_cuda_names_the_transfer_does_not_copy_stay_cuda_s():
    # As on the real stack: CUDA's own device-index helper still insists on a CUDA device.
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda._get_device_index(torch.device("supa", 0))
    # ... and CUDA helpers built on copied names answer for the SUPA card.
    assert torch.cuda.get_device_capability() == torch.supa.get_device_capability()


def test_versions_backends_and_profiler():
    major, minor = torch.version.cuda.split(".")
    assert major.isdigit() and minor.isdigit()
    assert torch.backends.cuda.is_built()
    assert torch.profiler.ProfilerActivity.CUDA == torch.profiler.ProfilerActivity.PrivateUse1
    assert torch._utils._get_available_device_type() == "supa"
    with pytest.raises(RuntimeError, match="Choose from: cublas, cublaslt, sublas, sublaslt"):
        torch.backends.cuda.preferred_blas_library("rocblas")


# ---- autocast -------------------------------------------------------------------------------

@pytest.mark.parametrize("enter", [
    lambda: torch.autocast("cuda", dtype=torch.bfloat16),
    lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16),
    lambda: torch.amp.autocast("cuda", dtype=torch.bfloat16),
    lambda: torch.cuda.amp.autocast(dtype=torch.bfloat16),
], ids=["positional", "keyword", "torch.amp", "torch.cuda.amp"])
def test_cuda_autocast_casts_supa_matmuls(enter):
    a, b = torch.randn(4, 4, device="cuda"), torch.randn(4, 4, device="cuda")
    with enter():
        assert torch.is_autocast_enabled("cuda") and torch.is_autocast_enabled("supa")
        assert (a @ b).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("supa")
    assert (a @ b).dtype == torch.float32


def test_custom_fwd_for_cuda_casts_the_inputs_under_cuda_autocast():
    class Seen(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(cast_inputs=torch.float16, device_type="cuda")
        def forward(ctx, x):
            ctx.seen = (x.dtype, torch.is_autocast_enabled("cuda"))
            return x * 1

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, grad):
            return grad

    x = torch.ones(3, device="cuda", requires_grad=True)
    with torch.autocast("cuda"):
        y = Seen.apply(x)
    assert y.dtype == torch.float16 and y.grad_fn.seen == (torch.float16, False)
    y.sum().backward()
    assert x.grad.dtype == torch.float32


def test_ops_cuda_autocast_bans_raise_cudas_error():
    p = torch.rand(4, device="cuda")
    with torch.autocast("cuda"), pytest.raises(RuntimeError, match="torch.nn.functional.binary_cross_entropy and "
                                                                  "torch.nn.BCELoss are unsafe to autocast"):
        torch.nn.functional.binary_cross_entropy(p, p)


# ---- checkpoints ----------------------------------------------------------------------------

def test_load_with_cuda_map_location_lands_on_that_card():
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(6.0, device="cuda").reshape(2, 3)}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="cuda:1")
    assert loaded["w"].device == torch.device("supa", 1)
    torch.testing.assert_close(loaded["w"].cpu(), torch.arange(6.0).reshape(2, 3))


def test_model_saved_on_the_cards_loads_onto_the_card_named_by_map_location():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).cuda()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location="cuda:1", weights_only=False)
    assert {p.device for p in loaded.parameters()} == {torch.device("supa", 1)}
    x = torch.randn(2, 4)
    torch.testing.assert_close(loaded(x.to("cuda:1")).cpu(), model(x.cuda()).cpu())


def _retag(checkpoint: bytes, old: bytes, new: bytes) -> bytes:
    """The same checkpoint with its storages' location tags rewritten (as if saved on another device)."""
    source, target = zipfile.ZipFile(io.BytesIO(checkpoint)), io.BytesIO()
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as out:
        for item in source.infolist():
            data = source.read(item)
            out.writestr(item, data.replace(old, new) if item.filename.endswith("data.pkl") else data)
    return target.getvalue()


def test_checkpoint_saved_on_a_cuda_machine_loads_onto_supa():
    buffer = io.BytesIO()
    torch.save(torch.arange(4.0, device="supa:1"), buffer)
    saved_on_cuda = _retag(buffer.getvalue(), b"supa:1", b"cuda:1")
    assert b"cuda:1" in saved_on_cuda
    loaded = torch.load(io.BytesIO(saved_on_cuda))
    assert loaded.device == torch.device("supa", 1)
    torch.testing.assert_close(loaded.cpu(), torch.arange(4.0))


def test_checkpoint_saved_on_a_cuda_card_this_host_lacks_raises_as_cuda_does():
    count = torch.cuda.device_count()
    if count > 9:
        pytest.skip("the checkpoint names card 9")
    buffer = io.BytesIO()
    torch.save(torch.arange(4.0, device="cuda:0"), buffer)
    saved_on_cuda = _retag(buffer.getvalue(), b"supa:0", b"cuda:9")  # same length: the pickle stays valid
    with pytest.raises(RuntimeError, match=f"^Attempting to deserialize object on SUPA device 9 but "
                                           f"torch.supa.device_count\\(\\) is {count}. Please use torch.load with "
                                           "map_location to map your storages to an existing device.$"):
        torch.load(io.BytesIO(saved_on_cuda))


# ---- torch.distributed ----------------------------------------------------------------------


@pytest.fixture
def single_rank_group():
    """Yields a function that initialises a 1-rank default group with the given backend."""
    def init(backend):
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_nccl_means_bccl(single_rank_group, backend):
    single_rank_group(backend)
    assert "bccl" in dist.get_backend() and "nccl" not in dist.get_backend()
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.testing.assert_close(x.cpu(), torch.ones(4))
    group = dist.new_group([0], backend="nccl")
    assert dist.get_backend(group) == "bccl"
    assert dist.is_nccl_available()


def test_new_subgroups_with_nccl_are_bccl_groups(single_rank_group):
    single_rank_group("nccl")
    group, groups = dist.new_subgroups(group_size=1, backend="nccl")
    assert dist.get_backend(group) == "bccl" and [dist.get_backend(g) for g in groups] == ["bccl"]
    group, groups = dist.new_subgroups_by_enumeration([[0]], backend="nccl")
    assert dist.get_backend(group) == "bccl" and [dist.get_backend(g) for g in groups] == ["bccl"]
    x = torch.ones(3, device="cuda")
    dist.all_reduce(x, group=group)
    torch.testing.assert_close(x.cpu(), torch.ones(3))


def test_device_mesh_on_cuda_is_on_supa(single_rank_group):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    single_rank_group("nccl")
    assert DeviceMesh("cuda", [0]).device_type == "supa"
    assert init_device_mesh("cuda", (1,)).device_type == "supa"


# ---- the switches, in fresh processes -------------------------------------------------------

_REPORT = """
import json, os, torch
report = {"cuda_available": torch.cuda.is_available(), "supa": hasattr(torch, "supa"),
          "autoload": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")}
try:
    report["cuda_tensor"] = str(torch.ones(1, device="cuda").device)
except Exception as exc:
    report["cuda_tensor"] = type(exc).__name__
try:  # CUDA's device type in a stream's fields means supa under the transfer only
    report["cuda_typed_stream"] = str(torch.supa.Stream(stream_id=0, device_index=0, device_type=1).device)
except Exception as exc:
    report["cuda_typed_stream"] = type(exc).__name__
print(json.dumps(report))
"""


def _reported(finished) -> dict:
    """What _REPORT printed, from a finished interpreter or shared case."""
    return json.loads(finished.stdout.strip().splitlines()[-1])


def _report(code, **env):
    return _reported(fresh_process(code, env={"BRTB_TRANSFER_SILENCE": "1", **env}))


_PLAIN_IMPORT = fresh_process(_REPORT, shared=ANY, name="test_transfer: plain import torch")


@pytest.mark.emulation_only
def test_plain_import_torch_applies_the_transfer():
    report = _reported(_PLAIN_IMPORT.result())
    assert report["cuda_available"] and report["cuda_tensor"] == "supa:0"
    assert report["cuda_typed_stream"] == "supa:0"


@pytest.mark.emulation_only
def test_import_torch_supa_first_gives_native_supa_without_the_transfer():
    report = _report("import torch_supa\n" + _REPORT)
    assert report["supa"] and not report["cuda_available"]
    assert report["cuda_typed_stream"] == "RuntimeError"
    assert report["cuda_tensor"] == "AssertionError"  # "Torch not compiled with CUDA enabled", as on CPU torch
    assert report["autoload"] == "0"  # the real package leaves autoload off for child processes
    report = _report("import torch_supa\nfrom torch_supa.contrib import transfer_to_supa\n" + _REPORT)
    assert report["cuda_available"] and report["cuda_tensor"] == "supa:0"


@pytest.mark.emulation_only
def test_transfer_can_be_switched_off():
    report = _report(_REPORT, SUPA_EMU_TRANSFER="0")
    assert report["supa"] and not report["cuda_available"] and report["cuda_tensor"] == "AssertionError"


@pytest.mark.emulation_only
def test_bad_transfer_switch_names_the_variable():
    result = fresh_process("import torch", env={"SUPA_EMU_TRANSFER": "sometimes"}, check=False)
    assert result.returncode != 0
    assert "SUPA_EMU_TRANSFER='sometimes'" in result.stderr and "1/0, true/false" in result.stderr


@pytest.mark.emulation_only
@pytest.mark.parametrize("env, shown", [({}, True), ({"RANK": "0"}, True), ({"RANK": "1"}, False),
                                        ({"BRTB_TRANSFER_SILENCE": "yes"}, False)])
def test_banner_once_on_rank_zero_unless_silenced(env, shown):
    code = "import warnings\nwarnings.simplefilter('always')\nimport torch\n"
    result = fresh_process(code, env={"BRTB_TRANSFER_SILENCE": None, **env})
    assert result.stderr.count("transfer_to_supa is active") == (1 if shown else 0)


_EMULATOR_OFF = {"report": fresh_process(_REPORT, env={"SUPA_EMULATE": "0"}, shared=ANY,
                                          name="test_transfer: emulator off, report"),
                 "torch_supa": fresh_process("import torch_supa", env={"SUPA_EMULATE": "0"}, shared=ANY,
                                             name="test_transfer: emulator off, import torch_supa")}


@pytest.mark.emulation_only
def test_emulator_off_means_no_torch_supa_and_no_transfer():
    report = _reported(_EMULATOR_OFF["report"].result())
    assert not report["supa"] and not report["cuda_available"]
    failed = _EMULATOR_OFF["torch_supa"].result(check=False)
    assert failed.error is not None and "No module named 'torch_supa'" in failed.error, failed.describe()


# ---- an unchanged CUDA-written DDP script on two cards ---------------------------------------

@pytest.mark.slow
def test_cuda_written_ddp_script_under_torchrun():
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    # Each rank is this file: it runs the script, then says what torch.supa counted (below).
    script = [__file__, ROOT / "examples" / "train_cuda_ddp.py", "--steps", "4"]
    result = fresh_process(torchrun_command(*script, nproc=2, port=PORT), timeout=600,
                           env={"BRTB_TRANSFER_SILENCE": "1"}, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"event"')]
    results = sorted((e for e in lines if e["event"] == "result"), key=lambda e: e["rank"])
    supa_figures = [e for e in lines if e["event"] == "supa"]
    assert [r["device"] for r in results] == ["supa:0", "supa:1"]
    assert all(r["backend"] == "bccl" and r["is_cuda"] for r in results)
    assert results[0]["parameters_sha256"] == results[1]["parameters_sha256"]
    assert all(len(r["step_ms"]) == 4 and all(ms > 0 for ms in r["step_ms"]) for r in results)
    assert sorted(r["max_memory_allocated"] for r in results) == sorted(s["max_memory_allocated"] for s in supa_figures)
    assert all(r["max_memory_allocated"] > 0 and r["memory_allocated"] > 0 for r in results)


if __name__ == "__main__":  # a torchrun rank of test_cuda_written_ddp_script_under_torchrun
    import sys

    run_as_main(sys.argv[1:])
    print_line(json.dumps({"event": "supa", "max_memory_allocated": torch.supa.max_memory_allocated(),
                           "memory_allocated": torch.supa.memory_allocated()}))


def test_host_empty_cache_binding_is_the_cards_as_the_real_transfer_maps_it():
    # torch._C._host_emptyCache exists in a CUDA build only; the real transfer maps it to torch_supa's.
    live = torch.arange(1 << 14, dtype=torch.float32).pin_memory()
    cached = torch.ones(1 << 14).pin_memory()
    reused = cached.data_ptr()
    del cached
    assert torch.ones(1 << 14).pin_memory().data_ptr() == reused  # the freed block was cached
    torch._C._host_emptyCache()
    assert live.is_pinned() and torch.equal(live, torch.arange(1 << 14, dtype=torch.float32))
    assert torch._C._host_emptyCache is not torch.accelerator.empty_host_cache
