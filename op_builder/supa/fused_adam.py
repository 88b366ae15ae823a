"""FusedAdamBuilder: DeepSpeed's `multi_tensor_adam` on SUPA (compiled kernel, else exact PyTorch fallback).

Semantics (those of DeepSpeed's fused kernel), per element, in fp32 arithmetic:
  mode 0 (Adam, L2):        g += decay * p
  m = beta1 * m + (1 - beta1) * g ;  v = beta2 * v + (1 - beta2) * g * g
  update = (m / bc1) / (sqrt(v / bc2) + eps)      bc_i = 1 - beta_i**step, or 1 without bias correction
  mode 1 (AdamW, decoupled): update += decay * p
  p -= lr * update
A nonzero `noop_flag` skips the step (parameters and states untouched).

Order of preference: torch_supa_ext's `deepspeed::multi_tensor_adam`; PyTorch's own fused Adam
kernels (`torch._fused_adam_` / `torch._fused_adamw_`), which compute the same formula in fp32
with one rounding on store and take the noop flag on the device (`found_inf`); a `torch._foreach_*`
chain. Each is probed on the parameters' device type and dtype before use.

The emulator's stand-in for the compiled kernel (supa_emu/torch_supa_ext/optimizers.py) is
written independently of this fallback on purpose: op_builder never imports the emulator, and
tests/test_torch_supa_ext.py holds the two against each other and both against torch.optim.
"""

import math
import threading

import torch

from . import builder, multi_tensor, supa_kernels

_fused_probe_lock = threading.Lock()
_fused_usable = {}  # (mode, device type, dtype) -> torch fused kernel or None


def _probe_ext_kernel(op, device):
    one = lambda: torch.ones(1, device=device)  # noqa: E731
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    op(2048, flag, [one()], [one()], [torch.zeros(1, device=device)], [torch.zeros(1, device=device)],
       1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)


def _torch_fused_kernel(mode, device, dtype):
    """PyTorch's fused Adam(W) kernel if it runs here and behaves as this module relies on.

    The probe checks the three properties used below: the AdamW/L2 formula, an infinite step
    count meaning "no bias correction" (beta**inf == 0), and `found_inf` == 1 skipping the update.
    """
    key = (mode, device.type, dtype)
    with _fused_probe_lock:
        if key in _fused_usable:
            return _fused_usable[key]
    kernel = getattr(torch, '_fused_adamw_' if mode == 1 else '_fused_adam_', None)
    if kernel is not None:
        try:
            p = torch.full((2, ), 1.0, dtype=dtype, device=device)
            g = torch.full((2, ), 1.0, dtype=dtype, device=device)
            m = torch.zeros(2, dtype=dtype, device=device)
            v = torch.zeros(2, dtype=dtype, device=device)
            inf_step = torch.full((), math.inf, device=device)
            skip = torch.ones(1, device=device)
            kernel([p], [g], [m], [v], [], [inf_step], lr=0.5, beta1=0.5, beta2=0.75, weight_decay=0.5, eps=0.0,
                   amsgrad=False, maximize=False, found_inf=skip)
            skipped = bool((p == 1).all() and (m == 0).all())
            kernel([p], [g], [m], [v], [], [inf_step], lr=0.5, beta1=0.5, beta2=0.75, weight_decay=0.5, eps=0.0,
                   amsgrad=False, maximize=False, found_inf=torch.zeros(1, device=device))
            # g=1, p=1: L2 -> g'=1.5, m=.75, v=.5625, update=1, p=.5 ; AdamW -> update=1+.5, p=.25
            expected = 0.25 if mode == 1 else 0.5
            if not (skipped and torch.allclose(p.float().cpu(), torch.full((2, ), expected))):
                kernel = None
        except Exception:
            kernel = None
    with _fused_probe_lock:
        _fused_usable[key] = kernel
    return kernel


def _foreach_adam(grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, mode, bias_correction,
                  weight_decay):
    g = multi_tensor.as_fp32(grads)
    p = multi_tensor.as_fp32(params)
    m = multi_tensor.as_fp32(exp_avgs)
    v = multi_tensor.as_fp32(exp_avg_sqs)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    if mode == 0 and weight_decay != 0:
        g = torch._foreach_add(g, p, alpha=weight_decay)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, bc1)
    torch._foreach_div_(update, denom)
    if mode == 1 and weight_decay != 0:
        torch._foreach_add_(update, p, alpha=weight_decay)
    torch._foreach_add_(p, update, alpha=-lr)
    multi_tensor.store(params, p)
    multi_tensor.store(exp_avgs, m)
    multi_tensor.store(exp_avg_sqs, v)


def adam_fallback(noop_flag, grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, mode,
                  bias_correction, weight_decay):
    """The pure-PyTorch `multi_tensor_adam` (lists of equal length, one dtype per list)."""
    if not params:
        return
    device = params[0].device
    kernel = None
    # beta in [0, 1) keeps both bias corrections finite and lets beta**inf stand for "none".
    if 0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and multi_tensor.same_dtype(grads, params, exp_avgs, exp_avg_sqs):
        kernel = _torch_fused_kernel(mode, device, params[0].dtype)
    if kernel is not None:
        step_t = torch.full((), float(step) if bias_correction else math.inf, device=device)
        skip = (noop_flag.to(device=device).reshape(-1)[:1] != 0).float() if noop_flag is not None else None
        kernel(params, grads, exp_avgs, exp_avg_sqs, [], [step_t] * len(params), lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, found_inf=skip)
        return
    if multi_tensor.step_skipped(noop_flag):
        return
    _foreach_adam(grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, step, mode, bias_correction,
                  weight_decay)


@torch.no_grad()  # DeepSpeed hands over bf16 Parameters themselves, outside no_grad
def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction,
                      weight_decay):
    """DeepSpeed's call: tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]."""
    multi_tensor.check_lists(tensor_lists)
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists
    if not params:
        return  # an empty parameter group: nothing to update
    kernel = supa_kernels.usable_kernel('multi_tensor_adam', params[0].device, _probe_ext_kernel)
    if kernel is not None:
        kernel(chunk_size, noop_flag, grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, epsilon, step, mode,
               bias_correction, weight_decay)
        return
    adam_fallback(noop_flag, grads, params, exp_avgs, exp_avg_sqs, lr, beta1, beta2, epsilon, step, mode,
                  bias_correction, weight_decay)


class FusedAdamBuilder(builder.SUPAPythonOpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_ADAM"
    NAME = "fused_adam"

    def absolute_name(self):
        return f'deepspeed.ops.adam.{self.NAME}_op'

    def ops(self):
        return {'multi_tensor_adam': multi_tensor_adam}
