"""torch.compile on SUPA cards: Dynamo's device interface, Inductor's supa backend, numerics
against eager PyTorch on the CPU, flex attention, dynamic shapes, placement rules, memory accounting, the
on-disk compile cache, and DeepSpeed's engine.compile() on two cards.

Compiling costs seconds per graph on two cores, so the models are tiny and each test compiles
as few graphs as it can. The references are plain PyTorch modules (nn.TransformerEncoderLayer,
nn.Sequential) run eagerly on the CPU.
"""

import copy
import gc
import os
import re
import sys

import pytest

import script_sequence
from harness import fresh_process
import torch
import torch.nn as nn

pytestmark = pytest.mark.skipif(not (hasattr(torch, "supa") and torch.supa.is_available()),
                                reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

MiB = 1 << 20
# Largest difference allowed, relative to the largest magnitude of the reference tensor.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def assert_close_relative(actual, expected, tol, what="", scale=None):
    """max |actual - expected| <= tol * scale; scale defaults to max |expected|."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    scale = expected.abs().max().item() if scale is None else scale
    error = (actual - expected).abs().max().item() / max(scale, 1e-12)
    assert error <= tol, f"{what}: relative error {error:.3g} > {tol:g}"


class CompileCounter:
    """A torch.compile backend that counts the graphs it is given and compiles them with Inductor."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph_module, example_inputs)


def last_device():
    return torch.device("supa", torch.supa.device_count() - 1)


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------
@pytest.mark.emulation_only
@pytest.mark.slow  # several fresh interpreters doing real work
def test_import_torch_loads_nothing_of_dynamo_or_inductor():
    out = fresh_process("""
        import sys, torch
        torch.randn(2, device="supa")
        print([m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor", "supa_emu.compile."))])
        from torch._dynamo.device_interface import get_interface_for_device
        print(get_interface_for_device("supa").__name__, get_interface_for_device("supa:1").__name__,
              "torch._inductor.codegen.common" in sys.modules)
    """)
    assert out.stdout.split("\n")[:2] == ["[]", "SupaInterface SupaInterface False"], out.stdout


def test_device_interface_answers_with_torch_supa():
    from torch._dynamo.device_interface import get_interface_for_device

    interface = get_interface_for_device("supa")
    assert interface.is_available() and interface.device_count() == torch.supa.device_count()
    assert interface.current_device() == torch.supa.current_device()
    device = last_device()
    with interface.device(device.index):
        assert torch.supa.current_device() == device.index
    previous = interface.exchange_device(device.index)
    assert torch.supa.current_device() == device.index
    interface.maybe_exchange_device(previous)
    assert torch.supa.current_device() == previous
    props = torch.supa.get_device_properties(device)
    assert interface.Worker.get_device_properties(device).name == props.name
    assert interface.get_compute_capability(device) == props.major * 10 + props.minor
    assert isinstance(interface.get_raw_stream(device.index), int)
    assert isinstance(interface.current_stream(), torch.Stream)
    assert issubclass(interface.Stream, torch.Stream) and issubclass(interface.Event, torch.Event)
    interface.synchronize(device)


# ------------------------------------------------------------------------------------------------
# Numerics against eager PyTorch on the CPU
# ------------------------------------------------------------------------------------------------
def attention_scores(q, k, v):
    weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return (weights @ v).relu().sum(dim=1), weights.amax(dim=-1)


def test_function_matches_eager_on_cpu():
    q, k, v = (torch.randn(3, 8, 16) for _ in range(3))
    expected = attention_scores(q, k, v)
    actual = torch.compile(attention_scores)(*(t.to("supa") for t in (q, k, v)))
    for a, e in zip(actual, expected):
        assert a.device.type == "supa"
        assert_close_relative(a, e, TOLERANCE[torch.float32])


@pytest.mark.emulation_only
def test_generated_code_runs_cpu_kernels_on_supa_memory():
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(64, 32, device="supa:1")
    out, (source, *_) = run_and_get_code(torch.compile(lambda a: (a @ a.T).relu().sum(0)), x)
    assert out.device == torch.device("supa:1")
    # A C++ kernel fused the relu and the reduction; its buffers come from the supa allocator
    # of the card the graph runs on; nothing is copied to or from the CPU.
    call = source[source.index("def call("):]
    assert "cpp_fused_relu_sum" in call
    assert "device=device(type='supa', index=1)" in call
    assert not re.search(r"empty_strided_cpu\(|\.copy_\(|\.cpu\(|\.to\(", call), call


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def transformer_block():
    return nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                      batch_first=True, norm_first=True)


def train(model, inputs, steps=3, **compile_kwargs):
    """Losses and final parameters of `steps` SGD steps (compiled when compile_kwargs are given)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    forward = torch.compile(model, **compile_kwargs) if compile_kwargs else model
    losses = []
    for _ in range(steps):
        loss = forward(inputs).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, list(model.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make_model, input_shape", [(mlp, (8, 16)), (transformer_block, (2, 6, 32))],
                         ids=["mlp", "transformer_block"])
def test_training_steps_match_eager_on_cpu(make_model, input_shape, dtype):
    torch.manual_seed(0)
    reference = make_model().to(dtype)
    model = copy.deepcopy(reference).to("supa")
    inputs = torch.randn(input_shape, dtype=dtype)
    expected_losses, expected_params = train(reference, inputs)
    # fullgraph=True: the whole forward is one graph, or compilation fails.
    losses, params = train(model, inputs.to("supa"), fullgraph=True)
    tol = TOLERANCE[dtype]
    for step, (loss, expected) in enumerate(zip(losses, expected_losses)):
        assert_close_relative(loss, expected, tol, f"loss of step {step}")
    # Parameters are measured against the model's largest weight: zero-initialised biases hold
    # only three updates, each rounded to bf16, so their own size is no yardstick.
    model_scale = max(p.detach().abs().max().item() for p in expected_params)
    for param, expected in zip(params, expected_params):
        assert param.device.type == "supa"
        assert_close_relative(param, expected, tol, f"parameter {tuple(expected.shape)}", scale=model_scale)


def test_new_batch_size_recompiles_once_with_dynamic_shapes():
    torch.manual_seed(0)
    reference = mlp()
    model = copy.deepcopy(reference).to("supa")
    torch._dynamo.reset()  # forget the sizes other tests compiled nn.Sequential.forward for
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        for batch in (4, 7, 9):
            inputs = torch.randn(batch, 16)
            assert_close_relative(compiled(inputs.to("supa")), reference(inputs), TOLERANCE[torch.float32],
                                  f"batch {batch}")
    # The second size recompiles with a symbolic batch dimension, which the third one reuses.
    assert counter.graphs == 2


def test_models_on_two_cards_run_on_their_own_card():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    inputs = torch.randn(4, 16)
    first, second = torch.device("supa", 0), last_device()
    models = {device: torch.compile(copy.deepcopy(reference).to(device)) for device in (first, second)}
    with torch.no_grad():
        expected = reference(inputs)
        for device, model in models.items():
            other = first if device == second else second
            torch.supa.reset_peak_memory_stats(other)
            other_peak = torch.supa.max_memory_allocated(other)
            out = model(inputs.to(device))
            assert out.device == device
            assert torch.supa.max_memory_allocated(other) == other_peak
            assert_close_relative(out, expected, TOLERANCE[torch.float32], str(device))


def test_cpu_input_to_supa_module_raises_the_eager_device_mismatch_error():
    model = nn.Linear(8, 4).to("supa")
    inputs = torch.randn(2, 8)
    mismatch = r"Expected all tensors to be on the same device, but found at least two devices, (supa:0 and cpu|cpu and supa:0)"
    with pytest.raises(RuntimeError, match=mismatch):
        model(inputs)
    with pytest.raises(RuntimeError, match=mismatch):
        torch.compile(model)(inputs)


def test_cpu_scalar_tensor_mixes_with_supa_tensors_as_in_eager():
    x, scale = torch.randn(16, device="supa"), torch.tensor(3.0)
    out = torch.compile(lambda a, s: (a * s + s).sin())(x, scale)
    assert out.device.type == "supa"
    assert_close_relative(out, (x.cpu() * scale + scale).sin(), TOLERANCE[torch.float32])


# ------------------------------------------------------------------------------------------------
# Memory: compiled code allocates from the card's allocator
# ------------------------------------------------------------------------------------------------
def two_matmuls(a):
    return (a @ a).relu() @ a


def test_compiled_allocations_are_counted_on_the_card():
    device = last_device()
    a = torch.randn(512, 512, device=device)  # 1 MiB
    compiled = torch.compile(two_matmuls)
    compiled(a)  # compile outside the measurement
    torch.supa.synchronize(device)
    base = torch.supa.memory_allocated(device)
    torch.supa.reset_peak_memory_stats(device)
    out = compiled(a)
    # The first product stays alive while the second one is written: two buffers at the peak.
    assert torch.supa.max_memory_allocated(device) - base >= 2 * a.nbytes
    assert torch.supa.memory_allocated(device) - base >= out.nbytes
    del out
    assert torch.supa.memory_allocated(device) == base


def test_compiled_allocation_beyond_the_capacity_raises_out_of_memory():
    device = last_device()
    # 10.6 MiB: from 10 MiB a request gets a segment of its own (rounded up to 2 MiB: 12 MiB), so no
    # segment has room for a second one.
    a = torch.randn(1664, 1664, device=device)
    compiled = torch.compile(two_matmuls)
    compiled(a)
    # Tensors of earlier tests that only the cycle collector frees could be freed in the middle of
    # the compiled call, and their blocks serve the products.
    gc.collect()
    torch.supa.empty_cache()
    # Free blocks left in split segments by earlier tests could serve the products without reserving:
    # hold every large free block of this stream, so that each product needs a segment of its own.
    with torch.supa.device(device):
        stream = torch.supa.current_stream().supa_stream
    held = [torch.empty(block["size"], dtype=torch.uint8, device=device)
            for segment in torch.supa.memory_snapshot() if segment["device"] == device.index
            and segment["stream"] == stream and segment["segment_type"] == "large"
            for block in segment["blocks"] if block["state"] == "inactive"]
    total = torch.supa.get_device_properties(device).total_memory
    reserved = torch.supa.memory_reserved(device)
    # Room for one more 12 MiB segment, not for the two the compiled code needs.
    torch.supa.set_per_process_memory_fraction((reserved + 16 * MiB) / total, device)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            compiled(a)
            # Not raised: say what served the products, so that a state this test did not foresee
            # can be named.
            segments = [(s["stream"], s["total_size"], [(b["size"], b["state"]) for b in s["blocks"]])
                        for s in torch.supa.memory_snapshot() if s["device"] == device.index]
            pytest.fail(f"no out-of-memory error: reserved {reserved} -> "
                        f"{torch.supa.memory_reserved(device)} bytes, segments {segments}")
    finally:
        torch.supa.set_per_process_memory_fraction(1.0, device)
        del held
    assert torch.allclose(compiled(a), two_matmuls(a))


# ------------------------------------------------------------------------------------------------
# Flex attention: the CPU C++ kernel for inference, fused kernels that hold what a card's hold for training
# ------------------------------------------------------------------------------------------------
FLEX_SHAPE = (2, 2, 128, 16)  # batch, heads, sequence, head dim: two 64-token blocks of the mask
RELATIVE_SLOPE = 0.05


@pytest.fixture
def flex_attention():
    """torch's flex_attention; its device check accepts supa (torch_supa.contrib.module, applied at activation)."""
    from torch.nn.attention import flex_attention as module

    return module.flex_attention


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_inputs(device, dtype, requires_grad=False):
    """q, k, v, a learnt bias per head and key, the score_mod adding it and a relative-position
    bias to the scores, and the causal block mask, all on `device` (same values on every device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(FLEX_SHAPE, generator=generator).to(dtype) for _ in range(3)]
    batch, heads, length, _ = FLEX_SHAPE
    tensors.append(torch.randn(heads, length, generator=generator))
    q, k, v, key_bias = (t.to(device).requires_grad_(requires_grad) for t in tensors)

    def biased(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) * RELATIVE_SLOPE + key_bias[h, kv_idx]

    return q, k, v, key_bias, biased, create_block_mask(causal, batch, heads, length, length, device=device)


def reference_attention(q, k, v, key_bias):
    """What the flex_attention call of flex_inputs computes, in plain fp32 ops."""
    q, k, v = (t.float() for t in (q, k, v))
    position = torch.arange(q.shape[-2])
    distance = position[:, None] - position[None, :]
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5 + distance * RELATIVE_SLOPE + key_bias[:, None, :]
    scores = scores.masked_fill(distance < 0, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.slow  # compiles a C++ kernel per dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_attention_inference_runs_the_cpu_kernel_on_the_card(flex_attention, dtype):
    from torch._inductor.utils import run_and_get_code

    device = last_device()
    q, k, v, _, score_mod, block_mask = flex_inputs("cpu", dtype)
    expected = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    q, k, v, _, score_mod, block_mask = flex_inputs(device, dtype)
    gc.collect()
    base = torch.supa.memory_allocated(device)
    with torch.no_grad():
        out, (source, *_) = run_and_get_code(torch.compile(flex_attention), q, k, v,
                                             score_mod=score_mod, block_mask=block_mask)
    assert out.device == device and out.dtype == dtype
    assert_close_relative(out, expected, TOLERANCE[dtype], "output")
    assert torch.supa.memory_allocated(device) - base >= out.nbytes
    # Inductor's flex attention C++ template, run on the card's memory, nothing copied to the CPU.
    call = source[source.index("def call("):]
    assert "cpp_fused_flex_attention" in call and f"device=device(type='supa', index={device.index})" in call
    assert not re.search(r"empty_strided_cpu\(|\.copy_\(|\.cpu\(|\.to\(", call), call


@pytest.mark.slow  # compiles a forward and a backward graph per dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_attention_training_matches_eager_on_cpu(flex_attention, dtype):
    device = last_device()
    q, k, v, key_bias, score_mod, block_mask = flex_inputs("cpu", dtype)
    expected = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    cpu_leaves = [t.detach().requires_grad_() for t in (q, k, v, key_bias)]
    reference = reference_attention(*cpu_leaves)
    reference.square().sum().backward()

    q, k, v, key_bias, score_mod, block_mask = flex_inputs(device, dtype, requires_grad=True)
    compiled = torch.compile(flex_attention)
    # A first call compiles; what compiling allocates on the card (cold or from the cache) is not
    # the kernel's, so the second call is the one measured.
    compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    gc.collect()  # what earlier tests left is not freed while this one measures
    torch.supa.synchronize(device)
    base = torch.supa.memory_allocated(device)
    torch.supa.reset_peak_memory_stats(device)
    out = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    # What a fused flex kernel writes (output, log-sum-exp, row maxima) is held to the byte by
    # test_compiled_flex_attention_holds_the_fused_kernels_buffers_not_the_scores; with this score_mod's
    # captured buffer the step's peak varied with what earlier tests left on the card (553 KiB more
    # in the whole suite's order), not explained yet.
    assert torch.supa.max_memory_allocated(device) - base >= fused_forward_bytes(FLEX_SHAPE, dtype)
    assert torch.supa.memory_allocated(device) - base >= out.nbytes
    out.float().square().sum().backward()

    tol = TOLERANCE[dtype]
    assert out.device == device and out.dtype == dtype
    assert_close_relative(out, expected, tol, "output")
    assert_close_relative(out, reference, tol, "output against the fp32 reference")
    for name, leaf, cpu_leaf in zip(("q", "k", "v", "key bias"), (q, k, v, key_bias), cpu_leaves):
        assert leaf.grad.device == device
        assert_close_relative(leaf.grad, cpu_leaf.grad, tol, f"gradient of {name}")


def card_bytes(nbytes: int) -> int:
    """What the card's allocator counts for a request of `nbytes` (512-byte blocks)."""
    return -(-nbytes // 512) * 512


def fused_forward_bytes(shape, dtype) -> int:
    """What the Triton flex attention template writes: the output in the query's dtype, and the
    log-sum-exp and the row maxima in float32 (torch/_inductor/kernel/flex/flex_attention.py)."""
    batch, heads, length, head_dim = shape
    rows = batch * heads * length
    return card_bytes(rows * head_dim * dtype.itemsize) + 2 * card_bytes(rows * 4)


@pytest.mark.slow  # compiles a forward and a backward graph
def test_compiled_flex_attention_holds_the_fused_kernels_buffers_not_the_scores(flex_attention):
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    device, dtype = last_device(), torch.bfloat16
    shape = batch, heads, length, head_dim = (1, 4, 1024, 16)  # the dense fp32 scores: 16 MiB; the output 128 KiB
    generator = torch.Generator().manual_seed(0)
    cpu = [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for _ in range(3)]
    # and_masks starts from a True made on the mask's device: the kernel makes it on the host.
    window = and_masks(causal, lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 300)
    cpu_mask = create_block_mask(window, batch, heads, length, length, device="cpu")
    expected = flex_attention(*cpu, block_mask=cpu_mask)
    grad_out = torch.randn(shape, generator=generator).to(dtype)
    expected.backward(grad_out)

    q, k, v = (t.detach().to(device).requires_grad_() for t in cpu)
    block_mask = create_block_mask(window, batch, heads, length, length, device=device)
    grad = grad_out.to(device)
    compiled = torch.compile(flex_attention)
    compiled(q, k, v, block_mask=block_mask).backward(grad)  # compile outside the measurement
    q.grad = k.grad = v.grad = None
    gc.collect()
    torch.supa.synchronize(device)
    base = torch.supa.memory_allocated(device)
    torch.supa.reset_peak_memory_stats(device)
    out = compiled(q, k, v, block_mask=block_mask)
    assert torch.supa.max_memory_allocated(device) - base == fused_forward_bytes(shape, dtype)
    before_backward = torch.supa.memory_allocated(device)
    torch.supa.reset_peak_memory_stats(device)
    out.backward(grad)
    # The backward kernel's buffers: delta (float32 rows) and dq, dk, dv, which become the gradients.
    rows, tensor = batch * heads * length, card_bytes(q.nbytes)
    assert torch.supa.max_memory_allocated(device) - before_backward == card_bytes(rows * 4) + 3 * tensor
    for name, leaf, cpu_leaf in zip("qkv", (q, k, v), cpu):
        assert_close_relative(leaf.grad, cpu_leaf.grad, TOLERANCE[dtype], f"gradient of {name}")
    assert_close_relative(out, expected, TOLERANCE[dtype], "output")


# ------------------------------------------------------------------------------------------------
# What cannot work on the emulator
# ------------------------------------------------------------------------------------------------
@pytest.mark.emulation_only
def test_reduce_overhead_runs_without_graphs_as_on_cpu():
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    x = torch.randn(8, 8, device="supa")
    out = torch.compile(lambda a: (a @ a).sigmoid(), mode="reduce-overhead")(x)
    assert_close_relative(out, (x.cpu() @ x.cpu()).sigmoid(), TOLERANCE[torch.float32])
    # Inductor declined to capture a CUDA graph, counted the skip and ran the compiled code.
    assert counters["inductor"]["cudagraph_skips"] == skips + 1


@pytest.mark.emulation_only
def test_cpp_wrapper_fails_with_an_error_that_says_it_is_unsupported():
    x = torch.randn(8, 8, device="supa")
    with torch._inductor.config.patch(cpp_wrapper=True):
        with pytest.raises(RuntimeError, match="cpp_wrapper=True .* is not supported on emulated SUPA cards"):
            torch.compile(lambda a: (a @ a).tanh())(x)


# ------------------------------------------------------------------------------------------------
# The on-disk compile cache
# ------------------------------------------------------------------------------------------------
def _compile_a_model(fingerprint: str | None = None) -> dict:
    """In a fresh interpreter: compiles a small model; Inductor's FX graph cache hits and misses.
    `fingerprint`: this interpreter plays another supa-emu, whose lowering or kernels differ."""
    from torch._dynamo.utils import counters

    if fingerprint is not None:
        from supa_emu.compile import inductor_config

        inductor_config.emulator_fingerprint = fingerprint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("supa")
    with torch.no_grad():
        out = torch.compile(model)(torch.randn(8, 16, device="supa"))
    return {"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
            "sum": out.sum().item()}


@pytest.mark.slow  # several fresh interpreters doing real work
def test_second_process_reuses_the_on_disk_compile_cache(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    # Two new interpreters, as a user's two runs: Inductor's cache key depends on the order of sys.modules.
    first, second = (fresh_process(_compile_a_model, env=env, torch_first=False).value for _ in range(2))
    assert (first["hit"], first["miss"]) == (0, 1), first
    assert (second["hit"], second["miss"]) == (1, 0), second
    assert second["sum"] == first["sum"]
    # Code compiled by another supa-emu is not served: it may call kernels whose schema changed.
    other = fresh_process(_compile_a_model, "another emulator", env=env, torch_first=False).value
    assert (other["hit"], other["miss"]) == (0, 1), other
    assert other["sum"] == first["sum"]


# ------------------------------------------------------------------------------------------------
# DeepSpeed: engine.compile() on two cards
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled_jobs(request, tmp_path_factory):
    """compiled_jobs(stage) -> the finished 2-rank run of examples/train_gpt.py --compile: the
    stages the selected tests ask for run one after the other in one job (tests/script_sequence.py)."""
    from test_deepspeed_training import WORLD, example_command, launch_in_sequence

    if torch.supa.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} SUPA cards")
    selected = sorted({item.callspec.params["stage"] for item in request.session.items if item.module is request.module
                       and item.originalname == test_deepspeed_engine_compile_trains_like_eager.__name__})
    # One Inductor cache for the runs: hermetic, and stages 1 and 2 compile the same graphs.
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}

    def run_together(stages):
        done = launch_in_sequence(
            {f"zero{stage}": example_command(f"zero{stage}.json", "--steps", 4, "--compile") for stage in stages},
            env=env)
        return {stage: done[f"zero{stage}"] for stage in stages}

    runs = script_sequence.batched(selected, run_together)
    return lambda stage: runs(stage).require_success()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_engine_compile_trains_like_eager(compiled_jobs, stage):
    """The compiled engine's losses are eager PyTorch's: the same model and data trained on the CPU in
    this process (test_deepspeed_training.reference, which the eager engine matches too)."""
    from test_deepspeed_training import FP32_TOLERANCE, SMALL, reference

    compiled = compiled_jobs(stage)
    assert compiled.event("compile")["graphs"] >= 1
    eager, _ = reference(f"zero{stage}.json", SMALL, 4)
    assert len(compiled.losses) == len(eager) == 4
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager), **FP32_TOLERANCE,
                               msg=lambda m: f"{m}\ncompiled: {compiled.losses}\neager: {eager}")
