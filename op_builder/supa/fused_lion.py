"""FusedLionBuilder: DeepSpeed's `multi_tensor_lion` on SUPA (compiled kernel, else exact PyTorch fallback).

Semantics (those of DeepSpeed's fused kernel), per element, in fp32 arithmetic:
  c = beta1 * m + (1 - beta1) * g
  p = p * (1 - lr * decay) + (-lr if c > 0 else +lr)      note: c == 0 moves p by +lr, not 0
  m = beta2 * m + (1 - beta2) * g
A nonzero `noop_flag` skips the step. `step` is accepted and unused, as in DeepSpeed.

Independent of the emulator's stand-in kernel (supa_emu/torch_supa_ext/optimizers.py) on
purpose, as explained in fused_adam.py.
"""

import torch

from . import builder, multi_tensor, supa_kernels


def _probe_ext_kernel(op, device):
    op(2048, torch.zeros(1, dtype=torch.int32, device=device), [torch.ones(1, device=device)],
       [torch.ones(1, device=device)], [torch.zeros(1, device=device)], 1e-4, 0.9, 0.99, 1, 0.0)


def lion_fallback(noop_flag, grads, params, exp_avgs, lr, beta1, beta2, step, weight_decay):
    """The pure-PyTorch `multi_tensor_lion` on `torch._foreach_*` ops."""
    if not params or multi_tensor.step_skipped(noop_flag):
        return
    g = multi_tensor.as_fp32(grads)
    p = multi_tensor.as_fp32(params)
    m = multi_tensor.as_fp32(exp_avgs)
    c = torch._foreach_mul(m, beta1)
    torch._foreach_add_(c, g, alpha=1 - beta1)
    # sign(c) - 0.5 is positive only where c > 0, so its sign is +1 there and -1 elsewhere (c == 0 too).
    direction = torch._foreach_sign(c)
    torch._foreach_sub_(direction, 0.5)
    torch._foreach_sign_(direction)
    if weight_decay != 0:
        torch._foreach_mul_(p, 1 - lr * weight_decay)
    torch._foreach_add_(p, direction, alpha=-lr)
    torch._foreach_mul_(m, beta2)
    torch._foreach_add_(m, g, alpha=1 - beta2)
    multi_tensor.store(params, p)
    multi_tensor.store(exp_avgs, m)


@torch.no_grad()  # DeepSpeed hands over bf16 Parameters themselves, outside no_grad
def multi_tensor_lion(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, step, weight_decay):
    """DeepSpeed's call: tensor_lists = [grads, params, exp_avgs]."""
    multi_tensor.check_lists(tensor_lists)
    grads, params, exp_avgs = tensor_lists
    if not params:
        return  # an empty parameter group: nothing to update
    kernel = supa_kernels.usable_kernel('multi_tensor_lion', params[0].device, _probe_ext_kernel)
    if kernel is not None:
        kernel(chunk_size, noop_flag, grads, params, exp_avgs, lr, beta1, beta2, step, weight_decay)
        return
    lion_fallback(noop_flag, grads, params, exp_avgs, lr, beta1, beta2, step, weight_decay)


class FusedLionBuilder(builder.SUPAPythonOpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_LION"
    NAME = "fused_lion"

    def absolute_name(self):
        return f'deepspeed.ops.lion.{self.NAME}_op'

    def ops(self):
        return {'multi_tensor_lion': multi_tensor_lion}
