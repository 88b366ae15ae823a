"""Emulated torch_supa_ext's reference kernels against plain-PyTorch references: layer norms, bias and
gated activations, residual adds, quantization, fused optimizers (torch.optim where it has them).

Op tests: collected only in test_torch_supa_ext.py's child run with SUPA_EMU_EXT=1 (see that file).
"""

import pytest
import torch
import torch.nn.functional as F

DEVICE = "supa"
needs_ext = pytest.mark.ext_ops  # collected only with SUPA_EMU_EXT=1 (see conftest.py)


@pytest.fixture(scope="module")
def ext():
    import torch_supa_ext
    return torch_supa_ext


# ---------------------------------------------------------------- reference kernels

def _dev(t):
    """A device copy of ``t`` (never ``t`` itself, so in-place kernels leave the reference alone)."""
    return t.to(DEVICE, copy=True)


def _assert_meta_agrees(op, args, out):
    """The fake implementation predicts the kernel's output shapes and dtypes."""
    meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    fake = op(*meta_args)
    outs, fakes = (out, fake) if isinstance(out, (list, tuple)) else ((out,), (fake,))
    assert len(outs) == len(fakes)
    for o, f in zip(outs, fakes):
        assert (o.shape, o.dtype) == (f.shape, f.dtype)


def _tol(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm(ext, dtype):
    x, gamma, beta = torch.randn(2, 5, 64), torch.randn(64), torch.randn(64)
    args = [_dev(x.to(dtype)), _dev(gamma.to(dtype)), _dev(beta.to(dtype)), 1e-5]
    out = torch.ops.deepspeed.layer_norm(*args)
    want = F.layer_norm(x.to(dtype).float(), (64,), gamma.to(dtype).float(), beta.to(dtype).float(), 1e-5)
    assert out.device.type == DEVICE and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed.layer_norm, args, out)


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_residual_variants(ext, dtype):
    x, bias, res = (torch.randn(3, 4, 32).to(dtype), torch.randn(32).to(dtype), torch.randn(3, 4, 32).to(dtype))
    gamma, beta = torch.randn(32).to(dtype), torch.randn(32).to(dtype)
    pre_ln = (x.float() + bias.float() + res.float()).to(dtype)
    want = F.layer_norm(pre_ln.float(), (32,), gamma.float(), beta.float(), 1e-6)
    args = [_dev(x), _dev(bias), _dev(res), _dev(gamma), _dev(beta), 1e-6]

    out = torch.ops.deepspeed._layer_norm_residual(*args)
    torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed._layer_norm_residual, args, out)

    norm, stored = torch.ops.deepspeed.layer_norm_residual_store_pre_ln_res(*args)
    torch.testing.assert_close(norm.cpu().float(), want, **_tol(dtype))
    torch.testing.assert_close(stored.cpu(), pre_ln, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed.layer_norm_residual_store_pre_ln_res, args, (norm, stored))


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name,act", [("bias_add", lambda v: v), ("bias_relu", lambda v: v.clamp(min=0)),
                                      ("bias_gelu", _gelu_tanh)])
def test_bias_activations(ext, dtype, name, act):
    x, b = torch.randn(2, 3, 48).to(dtype), torch.randn(48).to(dtype)
    args = [_dev(x), _dev(b)]
    before = x.clone()
    out = getattr(torch.ops.deepspeed, name)(*args)
    torch.testing.assert_close(out.cpu().float(), act(x.float() + b.float()), **_tol(dtype))
    torch.testing.assert_close(args[0].cpu(), before)  # inputs are not modified
    _assert_meta_agrees(getattr(torch.ops.deepspeed, name), args, out)


@needs_ext
def test_bias_residual(ext):
    x, b, r = torch.randn(2, 3, 16), torch.randn(16), torch.randn(2, 3, 16)
    out = torch.ops.deepspeed.bias_residual(_dev(x), _dev(b), _dev(r))
    torch.testing.assert_close(out.cpu(), x + r + b)
    # DeepSpeed's MoE layer passes a one-element placeholder meaning "no bias".
    out = torch.ops.deepspeed.bias_residual(_dev(x), torch.empty(1), _dev(r))
    torch.testing.assert_close(out.cpu(), x + r)


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("func_type,gate_fn", [(3, lambda g: 0.5 * g * (1 + torch.erf(g / 2 ** 0.5))),
                                               (4, lambda g: g * torch.sigmoid(g))])
def test_gated_activation(ext, dtype, func_type, gate_fn):
    x, b = torch.randn(2, 5, 40).to(dtype), torch.randn(40).to(dtype)
    args = [_dev(x), _dev(b), func_type]
    out = torch.ops.deepspeed.gated_activation(*args)
    xb = x.float() + b.float()
    want = xb[..., :20] * gate_fn(xb[..., 20:])
    assert out.shape == (2, 5, 20)
    torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed.gated_activation, args, out)
    with pytest.raises(Exception, match="activation_func_type"):
        torch.ops.deepspeed.gated_activation(_dev(x), _dev(b), 1)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nhwc_bias_adds(ext, dtype):
    x = torch.randn(2, 8, 5, 3).to(dtype).to(memory_format=torch.channels_last)
    other = torch.randn(2, 8, 5, 3).to(dtype).to(memory_format=torch.channels_last)
    bias, other_bias = torch.randn(8).to(dtype), torch.randn(8).to(dtype)
    per_channel = lambda t: t.float().view(1, 8, 1, 1)  # noqa: E731
    cases = {
        "nhwc_bias_add": ([x, bias], x.float() + per_channel(bias)),
        "nhwc_bias_add_add": ([x, bias, other], x.float() + per_channel(bias) + other.float()),
        "nhwc_bias_add_bias_add": ([x, bias, other, other_bias],
                                   x.float() + per_channel(bias) + other.float() + per_channel(other_bias)),
    }
    for name, (inputs, want) in cases.items():
        args = [_dev(t) for t in inputs]
        out = getattr(torch.ops.deepspeed, name)(*args)
        assert out.is_contiguous(memory_format=torch.channels_last), name
        torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
        _assert_meta_agrees(getattr(torch.ops.deepspeed, name), args, out)
    seq = torch.randn(2, 7, 8).to(dtype)  # [B, S, C] layout
    out = torch.ops.deepspeed.nhwc_bias_add(_dev(seq), _dev(bias))
    torch.testing.assert_close(out.cpu().float(), seq.float() + bias.float(), **_tol(dtype))


@needs_ext
def test_vector_add(ext):
    a, b = torch.randn(3, 17), torch.randn(3, 17)
    args = [_dev(a), _dev(b), 0.25]
    out = torch.ops.deepspeed._vector_add(*args)
    torch.testing.assert_close(out.cpu(), 0.25 * a + b)
    _assert_meta_agrees(torch.ops.deepspeed._vector_add, args, out)


@needs_ext
def test_moe_res_matmul_updates_output(ext):
    moe_res, output, coef = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(2, 16)
    dev_out = _dev(output)
    returned = torch.ops.deepspeed.moe_res_matmul(_dev(moe_res), _dev(coef), dev_out)
    want = output * coef[1] + moe_res * coef[0]
    torch.testing.assert_close(returned.cpu(), want)
    torch.testing.assert_close(dev_out.cpu(), want)  # DeepSpeed reads the result from `output`


@needs_ext
@pytest.mark.parametrize("mlp_after_attn,pre_layer_norm,add_bias",
                         [(True, True, True), (True, False, True), (False, False, True), (False, False, False)])
def test_residual_add_bias(ext, mlp_after_attn, pre_layer_norm, add_bias):
    hidden, residual, attn = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    attn_bias, final_bias, mp = torch.randn(8), torch.randn(8), 2
    if mlp_after_attn and pre_layer_norm:
        want = (residual + attn + attn_bias + final_bias) / mp + hidden
    elif mlp_after_attn:
        want = residual + hidden + final_bias
    else:
        want = hidden + attn + (residual + final_bias + (attn_bias if add_bias else 0)) / mp
    dev_residual = _dev(residual)
    out = torch.ops.deepspeed.residual_add_bias(_dev(hidden), dev_residual, _dev(attn), _dev(attn_bias),
                                                _dev(final_bias), mp, mlp_after_attn, add_bias, pre_layer_norm)
    assert out is None
    torch.testing.assert_close(dev_residual.cpu(), want)


# ------------------------------------------------ quantization (plain-math references)

def _int4_codes(packed):
    """Signed 4-bit codes, earlier element in the high nibble."""
    b = packed.to(torch.int32) & 0xFF
    high, low = b >> 4, b & 0xF
    high, low = torch.where(high >= 8, high - 16, high), torch.where(low >= 8, low - 16, low)
    return torch.stack([high, low], -1).reshape(*packed.shape[:-1], -1)


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("quant_type", [0, 1])
def test_quantize_dequantize_round_trip(ext, bits, quant_type):
    groups = 6
    x = torch.randn(4, 3, 64).half()
    args = [_dev(x), groups, bits, quant_type]
    q, params = torch.ops.deepspeed.quantize(*args)
    _assert_meta_agrees(torch.ops.deepspeed.quantize, args, [q, params])
    assert q.dtype == torch.int8 and params.dtype == torch.float32
    assert params.shape == (groups, 2 if quant_type else 1)

    codes = (q.cpu().to(torch.int32) if bits == 8 else _int4_codes(q.cpu())).reshape(groups, -1).float()
    xg = x.float().reshape(groups, -1)
    params = params.cpu()
    if quant_type == 0:
        step = 2 * xg.abs().amax(1, keepdim=True) / 2 ** bits
        offset = torch.zeros_like(step)
    else:
        hi, lo = xg.amax(1, keepdim=True), xg.amin(1, keepdim=True)
        step, offset = (hi - lo) / 2 ** bits, (hi + lo) / 2
        torch.testing.assert_close(params[:, 1:], offset)
    torch.testing.assert_close(params[:, :1], step)
    assert codes.min() >= -(2 ** (bits - 1)) and codes.max() <= 2 ** (bits - 1) - 1
    # Every code is the nearest level, except at the clamped top of the range.
    err = (codes * step + offset - xg).abs()
    top = codes == 2 ** (bits - 1) - 1
    assert bool((err[~top] <= step.expand_as(err)[~top] * 0.5001).all())
    assert bool((err[top] <= step.expand_as(err)[top] * 1.0001).all())

    for name, dtype in [("dequantize", torch.float16), ("dequantize_fp32", torch.float32)]:
        dq_args = [q, _dev(params), groups, bits, quant_type]
        out = getattr(torch.ops.deepspeed, name)(*dq_args)
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out.cpu().float(), (codes * step + offset).reshape(x.shape),
                                   rtol=1e-3, atol=1e-3)
        _assert_meta_agrees(getattr(torch.ops.deepspeed, name), dq_args, out)


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
def test_ds_quantize_symmetric_in_place(ext, bits):
    x = torch.randn(4, 256)
    vals = _dev(x)
    returned = torch.ops.deepspeed.ds_quantize(vals, 4, bits)
    assert returned.data_ptr() == vals.data_ptr()
    step = (2 * x.abs().amax(1, keepdim=True) + 1e-5) / 2 ** bits
    levels = vals.cpu() / step
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)  # values sit on the grid
    assert levels.min() >= -(2 ** (bits - 1)) - 1e-3 and levels.max() <= 2 ** (bits - 1) - 1 + 1e-3
    inside = x.abs() < step * (2 ** (bits - 1) - 1)
    assert bool(((vals.cpu() - x).abs()[inside] <= (step / 2 + 1e-6).expand_as(x)[inside]).all())


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
def test_ds_quantize_asymmetric_in_place(ext, bits):
    x = torch.rand(2, 128) * 3 + 1
    vals = _dev(x)
    assert torch.ops.deepspeed.ds_quantize_asym(vals, 2, bits).data_ptr() == vals.data_ptr()
    lo = x.amin(1, keepdim=True)
    step = (x.amax(1, keepdim=True) - lo + 1e-5) / 2 ** bits
    levels = (vals.cpu() - lo) / step
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)
    assert bool(((vals.cpu() - x).abs() <= step / 2 + 1e-6).all())


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_experimental(ext, bits):
    num_group, group_size = 4, 32
    codes = torch.randint(0, 2 ** bits, (num_group, group_size))
    if bits == 4:
        data = (codes[:, 0::2] * 16 + codes[:, 1::2]).to(torch.uint8)
    else:
        data = codes.to(torch.uint8)
    scale, minimum = (torch.rand(num_group) + 0.5).half(), torch.randn(num_group).half()
    args = [_dev(data), _dev(scale), _dev(minimum), num_group, group_size]
    op = getattr(torch.ops.deepspeed, f"dequantize_int{bits}_to_half_experimental")
    out = op(*args)
    want = codes.float() / scale.float()[:, None] + minimum.float()[:, None]
    assert out.dtype == torch.float16 and out.shape == (num_group, group_size)
    torch.testing.assert_close(out.cpu().float(), want, rtol=2e-3, atol=2e-3)
    _assert_meta_agrees(op, args, out)


# ------------------------------------------------ fused optimizers

CHUNK = 2048 * 32
SHAPES = [(33, 17), (5,), (2, 3, 7), (301,)]


def _noop(value=0):
    return torch.tensor([value], dtype=torch.int32, device=DEVICE)


def _grad_stream(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]


@needs_ext
@pytest.mark.parametrize("mode,weight_decay", [(0, 0.0), (0, 0.05), (1, 0.0), (1, 0.1)])
def test_multi_tensor_adam_matches_torch_optim(ext, mode, weight_decay):
    lr, betas, eps, steps = 1e-2, (0.9, 0.999), 1e-8, 60
    init = [torch.randn(s) for s in SHAPES]
    ref_params = [p.clone().requires_grad_() for p in init]
    ref_cls = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    ref = ref_cls(ref_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    params = [_dev(p) for p in init]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_grad_stream(steps), start=1):
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
        torch.ops.deepspeed.multi_tensor_adam(CHUNK, _noop(), [_dev(g) for g in grads], params, exp_avgs,
                                              exp_avg_sqs, lr, betas[0], betas[1], eps, step, mode, 1,
                                              weight_decay)
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-6)


@needs_ext
def test_multi_tensor_adam_without_bias_correction(ext):
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-6, 0.01
    p = torch.randn(SHAPES[0])
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    params, ms, vs = [_dev(p)], [_dev(m)], [_dev(v)]
    for step, (g, *_) in enumerate(_grad_stream(20), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (v.sqrt() + eps) + wd * p)
        torch.ops.deepspeed.multi_tensor_adam(CHUNK, _noop(), [_dev(g)], params, ms, vs,
                                              lr, b1, b2, eps, step, 1, 0, wd)
    torch.testing.assert_close(params[0].cpu(), p, rtol=1e-5, atol=1e-6)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_tensor_adam_low_precision(ext, dtype):
    # Reference: DeepSpeed's storage rule, fp32 math with params and states stored in `dtype`.
    lr, b1, b2, eps, wd, steps = 1e-2, 0.9, 0.999, 1e-8, 0.01, 50
    init = [torch.randn(s).to(dtype) for s in SHAPES]
    ref = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p)] for p in init]
    params = [_dev(p) for p in init]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_grad_stream(steps, seed=3), start=1):
        grads = [g.to(dtype) for g in grads]
        for state, g in zip(ref, grads):
            p, m, v = (t.float() for t in state)
            m = b1 * m + (1 - b1) * g.float()
            v = b2 * v + (1 - b2) * g.float() ** 2
            p = p - lr * ((m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps) + wd * p)
            state[:] = [p.to(dtype), m.to(dtype), v.to(dtype)]
        torch.ops.deepspeed.multi_tensor_adam(CHUNK, _noop(), [_dev(g) for g in grads], params, ms, vs,
                                              lr, b1, b2, eps, step, 1, 1, wd)
    for got, (want, _, _) in zip(params, ref):
        assert got.dtype == dtype
        # One storage rounding apart at most, compounded over the steps.
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_ext
@pytest.mark.parametrize("name", ["multi_tensor_adam", "multi_tensor_lion"])
def test_noop_flag_skips_the_step(ext, name):
    params = [_dev(torch.randn(s)) for s in SHAPES]
    states = [torch.ones_like(p) for p in params]
    before = [t.cpu() for t in params + states]
    grads = [torch.ones_like(p) for p in params]
    op = getattr(torch.ops.deepspeed, name)
    if name == "multi_tensor_adam":
        op(CHUNK, _noop(1), grads, params, states, [torch.ones_like(p) for p in params],
           1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    else:
        op(CHUNK, _noop(1), grads, params, states, 1e-2, 0.9, 0.99, 1, 0.0)
    for got, want in zip(params + states, before):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@needs_ext
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_multi_tensor_lion_matches_formula(ext, weight_decay):
    lr, b1, b2 = 1e-3, 0.9, 0.99
    init = [torch.randn(s) for s in SHAPES]
    ref = [[p.clone(), torch.zeros_like(p)] for p in init]
    params = [_dev(p) for p in init]
    exp_avgs = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_grad_stream(40, seed=7), start=1):
        for state, g in zip(ref, grads):
            p, m = state
            c = b1 * m + (1 - b1) * g
            p = p * (1 - lr * weight_decay) - lr * torch.where(c > 0, 1.0, -1.0)
            state[:] = [p, b2 * m + (1 - b2) * g]
        torch.ops.deepspeed.multi_tensor_lion(CHUNK, _noop(), [_dev(g) for g in grads], params, exp_avgs,
                                              lr, b1, b2, step, weight_decay)
    for got, m, (want_p, want_m) in zip(params, exp_avgs, ref):
        torch.testing.assert_close(got.cpu(), want_p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.cpu(), want_m, rtol=1e-5, atol=1e-6)
