"""Numerical specification of the SUPA FusedAdam / FusedLamb / FusedLion ops (supa_deepspeed.op_builder.supa).

References are independent of the code under test: torch.optim.Adam/AdamW, and the update rules
of DeepSpeed's fused kernels written out below in float64. Every case runs on CPU tensors and,
when a supa device is available, on supa tensors; the Adam cases also run with PyTorch's fused
kernel disabled, so the `torch._foreach_*` path is held to the same standard.
"""

import math

import pytest
import torch

from supa_deepspeed.op_builder.supa import FusedAdamBuilder, FusedLambBuilder, FusedLionBuilder
from supa_deepspeed.op_builder.supa import fused_adam as fused_adam_impl


def _supa_available():
    try:
        return hasattr(torch, 'supa') and torch.supa.is_available()
    except Exception:
        return False


DEVICES = ['cpu', pytest.param('supa', marks=pytest.mark.skipif(not _supa_available(), reason='no supa device'))]
CHUNK = 2048 * 32
SHAPES = [(7, ), (33, 5), (1000, ), (3, 4, 5)]


@pytest.fixture(params=['torch_fused', 'foreach'])
def adam_path(request, monkeypatch):
    """Run Adam through PyTorch's fused kernel (when this machine has it) and through the foreach chain."""
    if request.param == 'foreach':
        monkeypatch.setattr(fused_adam_impl, '_torch_fused_kernel', lambda *args: None)
    return request.param


@pytest.fixture(scope='module')
def adam_ops():
    return FusedAdamBuilder().load()


def _rel_err(actual, expected):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def _adam_run(ops, device, dtype, mode, steps, lr=1e-2, wd=0.1, betas=(0.9, 0.999), eps=1e-8, bias_correction=1,
              seed=0):
    """DeepSpeed-style FusedAdam loop through the loaded op; returns (params, the grads used per step)."""
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]
    p = [t.to(device=device, dtype=dtype, copy=True) for t in init]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for step in range(1, steps + 1):
        g = [t.to(device=device, dtype=dtype) for t in grads[step - 1]]
        ops.multi_tensor_adam(CHUNK, flag, [g, p, m, v], lr, betas[0], betas[1], eps, step, mode, bias_correction, wd)
    return init, grads, p, m, v


def _torch_optim_run(init, grads, mode, lr=1e-2, wd=0.1, betas=(0.9, 0.999), eps=1e-8, storage=None):
    """torch.optim.Adam/AdamW in fp32; with `storage`, p, m and v are rounded to that dtype after every
    step, which is how DeepSpeed's kernel stores 16-bit parameters and states."""
    params = [torch.nn.Parameter(t.clone()) for t in init]
    cls = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    opt = cls(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for g in grads:
        for q, gq in zip(params, g):
            q.grad = gq.clone()
        opt.step()
        if storage is not None:
            with torch.no_grad():
                for q in params:
                    for t in (q, opt.state[q]['exp_avg'], opt.state[q]['exp_avg_sq']):
                        t.copy_(t.to(storage))
    return [q.detach() for q in params], [opt.state[q]['exp_avg'] for q in params], \
        [opt.state[q]['exp_avg_sq'] for q in params]


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('mode', [0, 1], ids=['adam_l2', 'adamw'])
def test_adam_fp32_matches_torch_optim_over_60_steps(adam_ops, adam_path, device, mode):
    init, grads, p, m, v = _adam_run(adam_ops, device, torch.float32, mode, steps=60)
    ref_p, ref_m, ref_v = _torch_optim_run(init, grads, mode)
    for ours, ref in zip(p + m + v, ref_p + ref_m + ref_v):
        assert _rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('mode', [0, 1], ids=['adam_l2', 'adamw'])
def test_adam_bf16_matches_torch_optim_with_bf16_storage(adam_ops, adam_path, device, mode):
    # DeepSpeed passes bf16 parameters with bf16 states and the kernel rounds p, m, v to bf16 on
    # every store, so the reference is torch.optim in fp32 rounded the same way after each step.
    # Tolerance: 1e-2 of the largest parameter (about two bf16 ulps): fp32-vs-fp32 rounding
    # differences occasionally land on the other side of a bf16 rounding boundary.
    # (Against an unrounded fp32 trajectory the gap is ~5% after 60 steps: beta2 = 0.999 changes v
    # by less than half a bf16 ulp, so v barely decays. That is the format, not the optimizer.)
    init, grads, p, m, v = _adam_run(adam_ops, device, torch.bfloat16, mode, steps=60)
    init = [t.bfloat16().float() for t in init]
    grads = [[t.bfloat16().float() for t in g] for g in grads]
    ref_p, ref_m, ref_v = _torch_optim_run(init, grads, mode, storage=torch.bfloat16)
    for ours, ref in zip(p + m + v, ref_p + ref_m + ref_v):
        assert ours.dtype == torch.bfloat16
        assert _rel_err(ours, ref) < 1e-2


def _adam_reference_step(p, g, m, v, lr, b1, b2, eps, step, mode, bias_correction, wd):
    """DeepSpeed's multi_tensor_adam update rule in float64."""
    if mode == 0:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1 = 1 - b1**step if bias_correction else 1.0
    bc2 = 1 - b2**step if bias_correction else 1.0
    update = (m / bc1) / ((v / bc2).sqrt() + eps)
    if mode == 1:
        update = update + wd * p
    return p - lr * update, m, v


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('mode', [0, 1], ids=['adam_l2', 'adamw'])
@pytest.mark.parametrize('bias_correction', [0, 1], ids=['no_bias_correction', 'bias_correction'])
@pytest.mark.parametrize('dtype,tol', [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_adam_matches_kernel_formula(adam_ops, adam_path, device, mode, bias_correction, dtype, tol):
    gen = torch.Generator().manual_seed(1)
    p64 = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    m64 = [torch.zeros_like(t) for t in p64]
    v64 = [torch.zeros_like(t) for t in p64]
    p = [t.to(device=device, dtype=dtype, copy=True) for t in p64]
    p64 = [t.to(dtype).double() for t in p64]  # start both from the same representable values
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for step in range(1, 11):
        g64 = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in SHAPES]
        g = [t.to(device=device, dtype=dtype) for t in g64]
        adam_ops.multi_tensor_adam(CHUNK, flag, [g, p, m, v], 1e-2, 0.8, 0.95, 1e-6, step, mode, bias_correction, 0.05)
        for i in range(len(p64)):
            new = _adam_reference_step(p64[i], g64[i], m64[i], v64[i], 1e-2, 0.8, 0.95, 1e-6, step, mode,
                                       bias_correction, 0.05)
            p64[i], m64[i], v64[i] = (t.to(dtype).double() for t in new)  # the kernel stores in `dtype`
    for ours, ref in zip(p, p64):
        assert ours.dtype == dtype
        assert _rel_err(ours, ref) < tol


@pytest.mark.parametrize('device', DEVICES)
def test_adam_leaves_gradients_untouched(adam_ops, adam_path, device):
    p = [torch.randn(50, device=device)]
    g = [torch.randn(50, device=device)]
    g_before = g[0].clone()
    adam_ops.multi_tensor_adam(CHUNK, torch.zeros(1, dtype=torch.int32, device=device),
                               [g, p, [torch.zeros(50, device=device)], [torch.zeros(50, device=device)]], 1e-2, 0.9,
                               0.999, 1e-8, 1, 0, 1, 0.5)
    assert torch.equal(g[0], g_before)


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_adam_noop_flag_skips_the_step(adam_ops, adam_path, device, dtype):
    p = [torch.randn(s, device=device, dtype=dtype) for s in SHAPES]
    m = [torch.randn_like(t) for t in p]
    v = [torch.rand_like(t) for t in p]
    g = [torch.randn_like(t) for t in p]
    before = [t.clone() for t in p + m + v]
    flag = torch.ones(1, dtype=torch.int32, device=device)
    adam_ops.multi_tensor_adam(CHUNK, flag, [g, p, m, v], 1e-2, 0.9, 0.999, 1e-8, 3, 1, 1, 0.1)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, before))
    flag.zero_()
    adam_ops.multi_tensor_adam(CHUNK, flag, [g, p, m, v], 1e-2, 0.9, 0.999, 1e-8, 3, 1, 1, 0.1)
    # The step ran: the moments moved everywhere; a bfloat16 parameter of 7 elements may round back to
    # itself under a small update, so the parameters are checked together.
    changed = [not torch.equal(a, b) for a, b in zip(p + m, before)]
    assert any(changed[:len(p)]) and all(changed[len(p):])


def test_adam_empty_group_is_a_no_op_and_unequal_lists_raise(adam_ops):
    flag = torch.zeros(1, dtype=torch.int32)
    assert adam_ops.multi_tensor_adam(CHUNK, flag, [[], [], [], []], 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0) is None
    assert flag.tolist() == [0]
    p = torch.ones(3)
    m, v, g = torch.zeros(3), torch.zeros(3), torch.ones(3)
    for lists in ([[g], [], [], []], [[g], [p], [m], []]):  # a gradient or a state tensor without its pair
        with pytest.raises(RuntimeError, match="Size mismatch among tensor lists"):
            adam_ops.multi_tensor_adam(CHUNK, flag, lists, 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert torch.equal(p, torch.ones(3)) and torch.equal(m, torch.zeros(3))


# ---- Lion -------------------------------------------------------------------------------------


def _lion_reference_step(p, g, m, lr, b1, b2, wd):
    """DeepSpeed's multi_tensor_lion update rule in float64 (c == 0 moves p by +lr)."""
    c = b1 * m + (1 - b1) * g
    update = torch.where(c > 0, torch.full_like(c, -lr), torch.full_like(c, lr))
    return p * (1 - lr * wd) + update, b2 * m + (1 - b2) * g


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('dtype,tol', [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_lion_matches_kernel_formula(device, dtype, tol):
    ops = FusedLionBuilder().load()
    gen = torch.Generator().manual_seed(2)
    p64 = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in SHAPES]
    m64 = [torch.zeros_like(t) for t in p64]
    p = [t.to(device=device, dtype=dtype, copy=True) for t in p64]
    m = [torch.zeros_like(t) for t in p]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for step in range(1, 51):
        g64 = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).double() for s in SHAPES]
        g64[0][0] = 0.0  # with m == 0 at step 1 this is the c == 0 case
        g = [t.to(device=device, dtype=dtype) for t in g64]
        ops.multi_tensor_lion(CHUNK, flag, [g, p, m], 1e-3, 0.9, 0.99, step, 0.1)
        for i in range(len(p64)):
            new = _lion_reference_step(p64[i], g64[i], m64[i], 1e-3, 0.9, 0.99, 0.1)
            p64[i], m64[i] = (t.to(dtype).double() for t in new)  # the kernel stores in `dtype`
    for ours, ref in zip(p + m, p64 + m64):
        assert _rel_err(ours, ref) < tol


def test_lion_zero_direction_moves_by_plus_lr():
    ops = FusedLionBuilder().load()
    p, m, g = [torch.zeros(3)], [torch.zeros(3)], [torch.tensor([0.0, 1.0, -1.0])]
    ops.multi_tensor_lion(CHUNK, torch.zeros(1, dtype=torch.int32), [g, p, m], 0.5, 0.9, 0.99, 1, 0.0)
    assert p[0].tolist() == [0.5, -0.5, 0.5]


@pytest.mark.parametrize('device', DEVICES)
def test_lion_noop_flag_skips_the_step(device):
    ops = FusedLionBuilder().load()
    p, m, g = [torch.randn(9, device=device)], [torch.randn(9, device=device)], [torch.randn(9, device=device)]
    before = [p[0].clone(), m[0].clone()]
    ops.multi_tensor_lion(CHUNK, torch.ones(1, dtype=torch.int32, device=device), [g, p, m], 0.1, 0.9, 0.99, 1, 0.1)
    assert torch.equal(p[0], before[0]) and torch.equal(m[0], before[1])


# ---- Lamb -------------------------------------------------------------------------------------


def _lamb_reference_step(p, m, v, g, lr, b1, b2, max_coeff, min_coeff, eps, grad_scale, step, mode, bias_correction,
                         decay):
    """DeepSpeed's fused lamb kernel in float64; returns (p, m, v, coeff)."""
    g = g / grad_scale
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = (v + eps).sqrt() if mode == 0 else v.sqrt() + eps
    update = m / denom + decay * p
    w, u = p.norm().item(), update.norm().item()
    coeff = min(max(w / u, min_coeff), max_coeff) if w != 0 and u != 0 else 1.0
    step_size = lr * math.sqrt(1 - b2**step) / (1 - b1**step) if bias_correction else lr
    return p - step_size * coeff * update, m, v, coeff


@pytest.mark.parametrize('device', DEVICES)
@pytest.mark.parametrize('mode', [0, 1], ids=['eps_inside_sqrt', 'eps_outside_sqrt'])
@pytest.mark.parametrize('bias_correction', [0, 1])
@pytest.mark.parametrize('max_coeff', [10.0, 0.5], ids=['unclamped', 'clamped'])
def test_lamb_matches_kernel_formula(device, mode, bias_correction, max_coeff):
    ops = FusedLambBuilder().load()
    gen = torch.Generator().manual_seed(3)
    p64 = torch.randn(300, generator=gen, dtype=torch.float64)
    m64, v64 = torch.zeros_like(p64), torch.zeros_like(p64)
    p = p64.float().to(device)
    p64 = p64.float().double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step in range(1, 51):
        g64 = torch.randn(300, generator=gen, dtype=torch.float64).float().double()
        coeff = ops.lamb(p, torch.empty(0), m, v, g64.float().to(device), 1e-2, 0.9, 0.999, max_coeff, 0.01, 1e-6, 2.0,
                         step, mode, bias_correction, 0.01)
        p64, m64, v64, ref_coeff = _lamb_reference_step(p64, m64, v64, g64, 1e-2, 0.9, 0.999, max_coeff, 0.01, 1e-6,
                                                        2.0, step, mode, bias_correction, 0.01)
        assert coeff.shape == (1, ) and coeff.dtype == torch.float32
        assert coeff.item() == pytest.approx(ref_coeff, rel=1e-5)
    assert _rel_err(p, p64) < 1e-5
    assert _rel_err(m, m64) < 1e-5 and _rel_err(v, v64) < 1e-5


def test_lamb_zero_parameters_use_coefficient_one():
    ops = FusedLambBuilder().load()
    p = torch.zeros(10)
    coeff = ops.lamb(p, torch.empty(0), torch.zeros(10), torch.zeros(10), torch.ones(10), 1e-2, 0.9, 0.999, 10.0, 0.01,
                     1e-8, 1.0, 1, 1, 1, 0.0)
    assert coeff.item() == 1.0 and not torch.equal(p, torch.zeros(10))


def test_lamb_mixed_precision_writes_half_copy():
    ops = FusedLambBuilder().load()
    p = torch.randn(64)
    p_copy = torch.empty(64, dtype=torch.float16)
    ops.lamb(p, p_copy, torch.zeros(64), torch.zeros(64), torch.randn(64).half(), 1e-2, 0.9, 0.999, 10.0, 0.01, 1e-8,
             1.0, 1, 1, 1, 0.0)
    assert torch.equal(p_copy, p.half())


@pytest.mark.parametrize('device', DEVICES)
def test_parameters_requiring_grad_are_updated_in_place(adam_ops, adam_path, device):
    # DeepSpeed's FusedAdam/FusedLion pass bf16 Parameters themselves (not .data), outside no_grad.
    p = [torch.nn.Parameter(torch.randn(20, device=device, dtype=torch.bfloat16))]
    g = [torch.randn(20, device=device, dtype=torch.bfloat16)]
    before = p[0].detach().clone()
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    adam_ops.multi_tensor_adam(CHUNK, flag, [g, p, [torch.zeros_like(before)], [torch.zeros_like(before)]], 1e-2, 0.9,
                               0.999, 1e-8, 1, 1, 1, 0.0)
    FusedLionBuilder().load().multi_tensor_lion(CHUNK, flag, [g, p, [torch.zeros_like(before)]], 1e-2, 0.9, 0.99, 1,
                                                0.0)
    assert p[0].requires_grad and p[0].grad_fn is None
    assert not torch.equal(p[0].detach(), before)


def _fused_adam_against_adamw() -> None:
    """In a fresh interpreter: DeepSpeed's FusedAdam on the accelerator DeepSpeed chose, against
    torch's AdamW on the CPU."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import FusedAdam

    acc = get_accelerator()
    assert type(acc).__module__ == "deepspeed.accelerator.supa_accelerator"
    torch.manual_seed(0)
    ref = [torch.randn(64, 32), torch.randn(32)]
    params = [torch.nn.Parameter(p.clone().to(acc.device_name())) for p in ref]
    ref = [torch.nn.Parameter(p) for p in ref]
    fused = FusedAdam(params, lr=1e-2, weight_decay=0.1, adam_w_mode=True)
    plain = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step in range(20):
        grads = [torch.randn_like(p) for p in ref]
        for p, q, g in zip(params, ref, grads):
            p.grad, q.grad = g.to(p.device), g
        fused.step()
        plain.step()
    assert max(((p.detach().cpu() - q.detach()).abs().max() / q.detach().abs().max()).item()
               for p, q in zip(params, ref)) < 1e-5


@pytest.mark.emulation_only
@pytest.mark.slow  # several fresh interpreters doing real work
def test_deepspeed_builtin_supa_accelerator_runs_fused_adam_on_the_emulator():
    """DeepSpeed's own SUPA accelerator (SUPA_DS_ACCELERATOR=builtin) trains on the emulator too."""
    from harness import fresh_process

    fresh_process(_fused_adam_against_adamw,
                  env={"SUPA_EMULATE": "1", "SUPA_DS_ACCELERATOR": "builtin", "DS_ACCELERATOR": "supa"})
