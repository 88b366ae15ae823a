"""F.scaled_dot_product_attention on supa: the card's backend choice, its operators, values and memory.

A SUPA card has flash and memory-efficient attention, chosen under PyTorch's CUDA rules and the
torch.backends / sdpa_kernel switches, and run as the operators a card's SDPA calls; values are
held to PyTorch's math on CPU tensors, memory to the same calls on an NVIDIA H200
(docs/operator_memory.md).
"""

import functools
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

DEV = "supa"
FLASH = "ScaledDotProductFlashAttentionBackward0"
EFFICIENT = "ScaledDotProductEfficientAttentionBackward0"
TOLERANCE = {torch.float32: dict(atol=5e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True)
def default_switches():
    torch.supa.init()
    yield
    for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp,
                   torch.backends.cuda.enable_math_sdp):
        enable(True)
    gc.collect()


def tensors(*shapes, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes]


def math_on_cpu(q, k, v, **kwargs):
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def on_supa(value):
    return value.to(DEV) if torch.is_tensor(value) else value


def choice(q, k, v, **kwargs):
    return SDPBackend(torch._fused_sdp_choice(q, k, v, **kwargs))


B, H, L, E = 2, 4, 64, 16
VALUE_CASES = {
    # name: (shapes of q, k, v; dtype; keyword arguments; the kernel a card runs)
    "bf16 causal": ([(B, H, L, E)] * 3, torch.bfloat16, dict(is_causal=True), FLASH),
    "fp16": ([(B, H, L, E)] * 3, torch.float16, {}, FLASH),
    "bf16 grouped-query": ([(B, H, L, E), (B, 2, L, E), (B, 2, L, E)], torch.bfloat16, dict(enable_gqa=True), FLASH),
    "fp32 causal": ([(B, H, L, E)] * 3, torch.float32, dict(is_causal=True), EFFICIENT),
    "fp32 causal, fewer keys": ([(B, H, L, E), (B, H, 24, E), (B, H, 24, E)], torch.float32, dict(is_causal=True),
                                EFFICIENT),
    "fp32 boolean mask": ([(B, H, L, E)] * 3, torch.float32, dict(attn_mask=torch.rand(L, L) > 0.3), EFFICIENT),
    "bf16 additive mask": ([(B, H, L, E)] * 3, torch.bfloat16,
                           dict(attn_mask=torch.randn(B, 1, L, L).bfloat16()), EFFICIENT),
    "fp32 value head size 32": ([(B, H, L, E), (B, H, L, E), (B, H, L, 32)], torch.float32, {}, EFFICIENT),
    "fp32 3-D inputs": ([(H, L, E)] * 3, torch.float32, {}, "UnsafeViewBackward0"),
    "bf16 head size 6": ([(B, H, L, 6)] * 3, torch.bfloat16, dict(is_causal=True), FLASH),  # padded to 8
}


def graph_nodes(out):
    """The names of the autograd nodes that `out` was computed through."""
    names, pending, seen = [], [out.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(node.name())
        pending.extend(next_node for next_node, _ in node.next_functions)
    return names


def outputs_and_gradients(case, reference):
    """The output and the gradients of q, k, v of a case: by `reference` on CPU tensors, and on supa."""
    shapes, dtype, kwargs, _ = VALUE_CASES[case]
    cpu = [t.requires_grad_() for t in tensors(*shapes, dtype=dtype)]
    card = [t.detach().to(DEV).requires_grad_() for t in cpu]
    expected = reference(*cpu, **kwargs)
    actual = F.scaled_dot_product_attention(*card, **{name: on_supa(value) for name, value in kwargs.items()})
    assert actual.device.type == DEV
    grad = tensors(expected.shape, dtype=dtype, seed=1)[0]
    expected.backward(grad)
    actual.backward(grad.to(DEV))
    return [expected] + [t.grad for t in cpu], [actual.detach().cpu()] + [t.grad.cpu() for t in card]


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_values_and_gradients_match_the_math_on_cpu(case):
    for expected, actual in zip(*outputs_and_gradients(case, math_on_cpu)):
        torch.testing.assert_close(actual, expected, **TOLERANCE[VALUE_CASES[case][1]])


@pytest.mark.emulation_only
@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_each_case_runs_the_kernel_the_choice_names(case):
    shapes, dtype, kwargs, kernel = VALUE_CASES[case]
    q, k, v = (t.to(DEV).requires_grad_() for t in tensors(*shapes, dtype=dtype))
    out = F.scaled_dot_product_attention(q, k, v, **{name: on_supa(value) for name, value in kwargs.items()})
    assert kernel in graph_nodes(out)


@pytest.mark.emulation_only  # a card computes its own values; the emulated one the CPU's
@pytest.mark.parametrize("case", [name for name, (_, _, _, kernel) in VALUE_CASES.items()
                                  if kernel in (FLASH, EFFICIENT) and name != "fp32 value head size 32"])
def test_values_and_gradients_are_the_cpu_flash_kernels_bit_for_bit(case):
    # Where PyTorch's SDPA on CPU tensors runs its CPU flash kernel, supa's card kernels give its bits.
    for expected, actual in zip(*outputs_and_gradients(case, F.scaled_dot_product_attention)):
        assert torch.equal(actual, expected)


def test_gradient_of_an_additive_mask_matches_the_math_on_cpu():
    q, k, v = tensors((B, H, L, E), (B, H, L, E), (B, H, L, E))
    mask = torch.randn(B, H, L, L, requires_grad=True)
    card_mask = mask.detach().to(DEV).requires_grad_()
    math_on_cpu(q, k, v, attn_mask=mask).square().sum().backward()
    out = F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), v.to(DEV), attn_mask=card_mask)
    out.square().sum().backward()
    torch.testing.assert_close(card_mask.grad.cpu(), mask.grad, **TOLERANCE[torch.float32])


def test_dropout_follows_the_card_generator_and_backward_uses_forward_mask():
    q, k, v = tensors((B, 3, 16, 16), (B, 3, 16, 16), (B, 3, 16, 16))
    identity = torch.eye(16).expand(B, 3, 16, 16).contiguous()
    p = 0.3
    torch.supa.manual_seed(7)
    # With the identity as values the output is the dropped-out probabilities: the mask shows.
    dropped = F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), identity.to(DEV), dropout_p=p).cpu()
    mask = dropped != 0
    assert 0.6 < mask.float().mean() < 0.8
    torch.supa.manual_seed(7)
    card = [t.to(DEV).requires_grad_() for t in (q, k, v)]
    actual = F.scaled_dot_product_attention(*card, dropout_p=p)
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Dropout mask should only be used for testing purposes."
        expected = torch.ops.aten._scaled_dot_product_attention_math(*cpu, dropout_p=p, dropout_mask=mask)[0]
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCE[torch.float32])
    grad = torch.randn(expected.shape)
    expected.backward(grad)
    actual.backward(grad.to(DEV))
    for c, s in zip(cpu, card):
        torch.testing.assert_close(s.grad.cpu(), c.grad, **TOLERANCE[torch.float32])
    # The next call draws a new mask; reseeding draws the first one again.
    again = F.scaled_dot_product_attention(*card, dropout_p=p).detach().cpu()
    torch.supa.manual_seed(7)
    first = F.scaled_dot_product_attention(q.to(DEV), k.to(DEV), identity.to(DEV), dropout_p=p).cpu()
    assert not torch.equal(again, actual.detach().cpu())
    assert torch.equal(first, dropped)


def qkv(dtype=torch.bfloat16, head_dim=64, kv_heads=H, strided=False):
    q, k, v = (t.to(DEV) for t in tensors((B, H, L, head_dim), (B, kv_heads, L, head_dim),
                                          (B, kv_heads, L, head_dim), dtype=dtype))
    if strided:  # last dimension not contiguous
        q = torch.randn(B, H, L, head_dim * 2, device=DEV).to(dtype)[..., ::2]
    return q, k, v


CHOICES = [
    # inputs, keyword arguments, the card's backend (PyTorch's CUDA rules on an sm80-or-newer GPU)
    (dict(), dict(is_causal=True), SDPBackend.FLASH_ATTENTION),
    (dict(dtype=torch.float16), dict(), SDPBackend.FLASH_ATTENTION),
    (dict(dtype=torch.float32), dict(is_causal=True), SDPBackend.EFFICIENT_ATTENTION),
    (dict(), dict(attn_mask=torch.ones(L, L, dtype=torch.bool).tril()), SDPBackend.EFFICIENT_ATTENTION),
    (dict(head_dim=6), dict(), SDPBackend.FLASH_ATTENTION),  # flash has no alignment rule
    (dict(dtype=torch.float32, head_dim=6), dict(), SDPBackend.MATH),  # memory-efficient needs 4 | head_dim
    (dict(head_dim=512), dict(), SDPBackend.EFFICIENT_ATTENTION),  # flash takes head_dim <= 256
    (dict(kv_heads=2), dict(enable_gqa=True), SDPBackend.FLASH_ATTENTION),
    (dict(dtype=torch.float32, kv_heads=2), dict(enable_gqa=True), SDPBackend.MATH),
    (dict(strided=True), dict(), SDPBackend.MATH),
    (dict(), dict(dropout_p=0.1), SDPBackend.EFFICIENT_ATTENTION),  # CUDA: flash (sdp_choice.cpp says why)
]


@pytest.mark.emulation_only  # the card's choice as the emulator models it
@pytest.mark.parametrize("inputs, kwargs, backend", CHOICES, ids=[str(i) for i in range(len(CHOICES))])
def test_choice_follows_the_cuda_rules_and_is_what_runs(inputs, kwargs, backend):
    q, k, v = qkv(**inputs)
    kwargs = {name: value.to(DEV) if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    assert choice(q, k, v, **kwargs) == backend
    kernels = {SDPBackend.FLASH_ATTENTION: FLASH, SDPBackend.EFFICIENT_ATTENTION: EFFICIENT}
    ran = graph_nodes(F.scaled_dot_product_attention(q.requires_grad_(), k, v, **kwargs))
    assert kernels[backend] in ran if backend in kernels else not set(ran) & set(kernels.values())


@pytest.mark.emulation_only  # the card's choice as the emulator models it
def test_backend_switches_and_sdpa_kernel_are_obeyed():
    q, k, v = qkv()
    torch.backends.cuda.enable_flash_sdp(False)
    assert choice(q, k, v) == SDPBackend.EFFICIENT_ATTENTION
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    assert choice(q, k, v) == SDPBackend.MATH
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    with sdpa_kernel([SDPBackend.MATH]):
        assert choice(q, k, v) == SDPBackend.MATH
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert choice(q, k, v) == SDPBackend.EFFICIENT_ATTENTION
        assert F.scaled_dot_product_attention(q.requires_grad_(), k, v).grad_fn.name() == EFFICIENT
    assert choice(q, k, v) == SDPBackend.FLASH_ATTENTION


@pytest.mark.emulation_only  # the card's choice as the emulator models it
def test_can_use_answers_agree_with_the_choice():
    if not torch.backends.cuda.is_flash_attention_available():
        pytest.skip("CUDA names do not mean supa in this process (no transfer_to_supa)")
    q, k, v = qkv()
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, False)
    assert torch.backends.cuda.can_use_flash_attention(params)
    assert torch.backends.cuda.can_use_efficient_attention(params)
    assert not torch.backends.cuda.can_use_cudnn_attention(params)
    masked = torch.backends.cuda.SDPAParams(q, k, v, torch.zeros(L, L, dtype=q.dtype, device=DEV), 0.0, False,
                                            False)
    with pytest.warns(UserWarning, match="Flash Attention does not support non-null attn_mask"):
        assert not torch.backends.cuda.can_use_flash_attention(masked, True)
    assert torch.backends.cuda.can_use_efficient_attention(masked)
    on_cpu = torch.backends.cuda.SDPAParams(q.cpu(), k.cpu(), v.cpu(), None, 0.0, True, False)
    assert not torch.backends.cuda.can_use_flash_attention(on_cpu)


def warnings_and_error(backends, **kwargs):
    q, k, v = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sdpa_kernel(backends), pytest.raises(RuntimeError, match=r"^No available kernel\. Aborting execution\.$"):
            F.scaled_dot_product_attention(q, k, v, **kwargs)
    return [str(w.message).split(" (Triggered internally")[0] for w in caught]


@pytest.mark.emulation_only  # the card's choice as the emulator models it
def test_cudnn_only_raises_no_available_kernel_with_the_cuda_warnings():
    assert warnings_and_error([SDPBackend.CUDNN_ATTENTION]) == [
        "Memory efficient kernel not used because:",
        "Memory Efficient attention has been runtime disabled.",
        "Flash attention kernel not used because:",
        "Flash attention has been runtime disabled.",
        "cuDNN attention kernel not used because:",
        "Torch was not compiled with cuDNN attention.",
    ]


@pytest.mark.emulation_only  # the card's choice as the emulator models it
def test_flash_with_a_float_mask_raises_no_available_kernel():
    messages = warnings_and_error([SDPBackend.FLASH_ATTENTION], attn_mask=torch.zeros(L, L, device=DEV))
    assert "Flash Attention does not support non-null attn_mask." in messages


FLASH_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")
EFFICIENT_OPS = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward")


def forward_and_backward(q, k, v, **kwargs):
    F.scaled_dot_product_attention(*(t.requires_grad_() for t in (q, k, v)), **kwargs).sum().backward()


def test_profiler_names_the_cards_operators():
    q, k, v = qkv()
    with torch.profiler.profile() as prof:
        forward_and_backward(q, k, v, is_causal=True)  # flash
        forward_and_backward(*(t.detach().float() for t in (q, k, v)), is_causal=True)  # memory-efficient
    names = {event.key for event in prof.key_averages()}
    assert {f"aten::{op}" for op in FLASH_OPS + EFFICIENT_OPS} <= names
    assert not [name for name in names if "_for_cpu" in name]
    assert "aten::softmax" not in names


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype, ops", [(torch.bfloat16, FLASH_OPS), (torch.float32, EFFICIENT_OPS)],
                         ids=["flash", "memory-efficient"])
def test_dispatch_modes_see_the_cards_operators(dtype, ops):
    q, k, v = qkv(dtype=dtype)
    with OpNames() as seen:
        forward_and_backward(q, k, v, is_causal=True)
    assert [name for name in seen.names if "attention" in name] == [f"aten::{op}" for op in ops]


def results_alike(actual, expected, device):
    """Tensors of the same shape, strides and dtype on `device` (meta results: on the meta device); the rest equal."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if isinstance(e, torch.Tensor):
            assert (a.shape, a.stride(), a.dtype, a.device) == (e.shape, e.stride(), e.dtype, device)
        else:
            assert a == e


@pytest.mark.emulation_only  # a card's kernel returns these; the emulated one is held to PyTorch's meta function
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["", "grouped-query"])
def test_flash_operator_returns_what_a_card_returns(kv_heads):
    q, k, v = qkv(kv_heads=kv_heads)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, L, H, E) in memory, as a model's projections give it
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    results = flash(q, k, v, is_causal=True, scale=0.125)
    on_meta = flash(*(t.to("meta") for t in (q, k, v)), is_causal=True, scale=0.125)
    results_alike(results, on_meta, q.device)
    out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask = results
    assert (cum_seq_q, cum_seq_k, max_q, max_k) == (None, None, L, L)
    assert rng_state.tolist() == [0, 0] and unused.item() == 0  # no dropout: nothing drawn
    grad = torch.randn_like(out)
    backward = torch.ops.aten._scaled_dot_product_flash_attention_backward
    arguments = (grad, q, k, v, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, 0.0, True, rng_state, unused)
    meta_arguments = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in arguments]
    results_alike(backward(*arguments, scale=0.125), backward(*meta_arguments, scale=0.125), q.device)


@pytest.mark.emulation_only  # the card's choice as the emulator models it
def test_flash_operator_refuses_dropout_which_scaled_dot_product_attention_gives_memory_efficient_attention():
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="flash attention on supa takes no dropout"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.1)


@pytest.mark.emulation_only
def test_head_sizes_are_padded_for_flash_as_on_cuda():
    # PyTorch's composite on CUDA pads the head size to a multiple of 8 for the flash call, with
    # the unpadded size's scale, and slices the output: its strides and the kept operands show it.
    device = torch.device(DEV, torch.supa.device_count() - 1)
    q, k, v = (t.to(device).requires_grad_() for t in tensors(*[(B, H, L, 6)] * 3, dtype=torch.bfloat16))
    base = torch.supa.memory_allocated(device)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (B, H, L, 6) and out.stride() == (H * L * 8, L * 8, 8, 1)
    assert graph_nodes(out)[:3] == ["SliceBackward0", FLASH, "ConstantPadNdBackward0"]
    padded_operand = B * H * L * 8 * 2
    lse = B * H * L * 4
    assert out.untyped_storage().nbytes() == padded_operand
    kept = torch.supa.memory_allocated(device) - base - padded_operand
    assert kept == 3 * padded_operand + lse + 2 * 512  # padded q, k, v; log-sum-exp; rng_state and unused


def checkpointed_attention_calls(policy):
    """Calls of the flash operator in a forward and backward through selective activation checkpointing."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    def block(x, w):
        q, k, v = (x @ w).chunk(3, dim=-1)
        shape = (B, L, H, E)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, H * E).sin()

    x, w = (t.to(DEV).requires_grad_() for t in tensors((B, L, H * E), (H * E, 3 * H * E), dtype=torch.bfloat16))
    with OpNames() as seen:
        out = checkpoint(block, x, w, use_reentrant=False,
                         context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        out.float().square().sum().backward()
    expected = [t.detach().requires_grad_() for t in (x, w)]
    block(*expected).float().square().sum().backward()
    for checkpointed, plain in zip((x, w), expected):
        assert torch.equal(checkpointed.grad, plain.grad)
    return seen.names.count("aten::_scaled_dot_product_flash_attention")


def test_selective_checkpointing_saves_attention_by_the_cards_op_name():
    from torch.utils.checkpoint import CheckpointPolicy

    # torchtitan's policy: save the attention operators a card dispatches to, recompute the rest.
    saved = {torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_cudnn_attention.default}

    def save_attention(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    def recompute_all(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    assert checkpointed_attention_calls(save_attention) == 1  # backward reuses the forward's result
    assert checkpointed_attention_calls(recompute_all) == 2


@pytest.mark.emulation_only
def test_compiled_attention_calls_the_fused_kernel():
    from torch._inductor.utils import run_and_get_code

    q, k, v = tensors((B, H, L, E), (B, H, L, E), (B, H, L, E))
    expected = math_on_cpu(q, k, v, is_causal=True)
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    with torch._inductor.config.patch(fx_graph_cache=False):  # generate the code, not a cached copy
        actual, (source, *_) = run_and_get_code(compiled, q.to(DEV), k.to(DEV), v.to(DEV))
    assert "_scaled_dot_product_efficient_attention" in source
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCE[torch.float32])


# Measured on an NVIDIA H200 (torch 2.11.0+cu130, tests/data/fidelity/card_kernels.py, 2026-11-26):
# q, k, v requiring grad, causal; bytes. "default" is the card's own choice.
H200 = {
    ("bf16", "default"): dict(kept=263168, forward_peak=8652288, backward_peak=50595328),
    ("bf16", "math"): dict(kept=352321536, forward_peak=725680640, backward_peak=838861824),
    ("fp32", "default"): dict(kept=262144, forward_peak=17039360, backward_peak=84411392),
}


def card_memory(dtype, backends=None):
    """Bytes kept after forward beyond the output, forward peak over the inputs, backward peak over its start."""
    device = torch.device(DEV, torch.supa.device_count() - 1)
    q, k, v = (t.to(device).requires_grad_() for t in tensors(*[(4, 16, 1024, 64)] * 3, dtype=dtype))
    base = torch.supa.memory_allocated(device)
    torch.supa.reset_peak_memory_stats(device)
    with sdpa_kernel(backends or [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    kept = torch.supa.memory_allocated(device) - base - out.untyped_storage().nbytes()
    forward_peak = torch.supa.max_memory_allocated(device) - base
    torch.supa.reset_peak_memory_stats(device)
    start = torch.supa.memory_allocated(device)
    out.sum().backward()
    return dict(kept=kept, forward_peak=forward_peak,
                backward_peak=torch.supa.max_memory_allocated(device) - start)


@pytest.mark.emulation_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_attention_holds_what_the_h200_holds(dtype):
    card = H200[({torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype], "default")]
    emulated = card_memory(dtype)
    # Kept for backward: the log-sum-exp and the dropout seed and offset, nothing of size s x s. Flash
    # (bf16) keeps what the card keeps; memory-efficient attention (fp32) keeps its seed and offset on
    # the card, where CUDA's kernel returns host scalars without dropout: two 512-byte blocks more.
    assert emulated["kept"] == card["kept"] + {torch.bfloat16: 0, torch.float32: 1024}[dtype]
    for figure in ("forward_peak", "backward_peak"):
        assert abs(emulated[figure] / card[figure] - 1) < 0.01, (figure, emulated[figure], card[figure])


@pytest.mark.emulation_only
def test_grouped_query_attention_backward_holds_what_the_h200_holds():
    # q (2, 16, 1024, 128), k and v with 4 heads, bf16, causal: the card's kernel keeps the key and
    # value gradients of all 16 query heads while it runs (tests/data/fidelity/h200_gqa_attention.json).
    import json
    import pathlib

    measured = json.loads((pathlib.Path(__file__).parent / "data" / "fidelity" / "h200_gqa_attention.json").read_text())
    device = torch.device(DEV, torch.supa.device_count() - 1)
    figures = {}
    for name, heads in (("default_gqa", 4), ("default_no_gqa_16heads", 16)):
        q = torch.randn(2, 16, 1024, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
        k, v = (torch.randn(2, heads, 1024, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
                for _ in range(2))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != 16)
        grad = torch.ones_like(out)
        start = torch.supa.memory_allocated(device)
        torch.supa.reset_peak_memory_stats(device)
        out.backward(grad)
        figures[name] = torch.supa.max_memory_allocated(device) - start
        card = measured[name]["backward_peak_over_start"]
        # The card's figure is cuDNN's kernel (the H200's default), which holds one 512-byte block
        # beyond what the flash memory model holds; within 1% either way, as the other kernels.
        assert abs(figures[name] / card - 1) < 0.01, (name, figures[name], card)
    assert figures["default_gqa"] > figures["default_no_gqa_16heads"]  # as on the card


@pytest.mark.emulation_only
@pytest.mark.slow  # the math path materialises 4 x 16 x 1024 x 1024 probabilities
def test_math_path_holds_the_probabilities_as_on_the_h200():
    emulated = card_memory(torch.bfloat16, [SDPBackend.MATH])
    card = H200[("bf16", "math")]
    assert emulated["kept"] > 1000 * H200[("bf16", "default")]["kept"]
    assert 0.8 < emulated["kept"] / card["kept"] < 1.2
