"""Reference kernels for the fused optimizer ops that have SUPA kernels: multi_tensor_adam and multi_tensor_lion.

Meaning, as in DeepSpeed's multi-tensor CUDA kernels (one launch updates whole tensor lists):
- Adam, mode 0 (L2): ``g += wd * p`` before the moments; mode 1 (AdamW): ``wd * p`` is added to
  the update instead. ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g``,
  ``p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)`` with ``bc = 1 - beta**step`` when bias_correction
  is 1, else 1.
- Lion: ``c = b1*m + (1-b1)*g``; ``p = p*(1 - lr*wd) - lr`` where ``c > 0``, ``+ lr`` elsewhere
  (DeepSpeed's kernel, zero included); ``m = b2*m + (1-b2)*g``.
- ``noop_flag`` nonzero skips the whole call (one read of the flag per call, not per tensor).
- Math in fp32; fp16/bf16 parameters and states are updated through fp32 copies and written
  back, as the CUDA kernels do in registers. ``chunk_size`` only shapes GPU launches.

Everything runs on ``torch._foreach_*`` ops so a call costs a handful of list-wide passes.

These stand in for Biren's compiled kernels and are written independently of the pure-PyTorch
fallbacks in op_builder/supa/fused_adam.py and fused_lion.py (which run on a real card when the
extension is absent and must not import the emulator): each is a cross-check of the other, held
against each other and against torch.optim in tests/test_torch_supa_ext.py and
tests/test_fused_optimizers.py.
"""

import math

import torch


def _skip(noop_flag: torch.Tensor) -> bool:
    return bool(noop_flag.ne(0).any().item())


def _in_fp32(grads, *updated):
    """Run the math in fp32: returns ``(grads, *updated)`` as fp32 lists plus the write-back plan.

    fp32 tensors are used as they are (updated in place); others are upcast copies, and the
    plan lists the ``(originals, copies)`` pairs of the updated lists to copy back afterwards.
    Gradients are only read, so they never need writing back.
    """
    lists = (grads,) + updated
    if all(t.dtype == torch.float32 for group in lists for t in group):
        return lists, []
    work = [[t.float() for t in group] for group in lists]
    writeback = [(orig, copy) for orig, copy in zip(updated, work[1:])
                 if any(t.dtype != torch.float32 for t in orig)]
    return work, writeback


def _write_back(writeback):
    for targets, sources in writeback:
        torch._foreach_copy_(targets, sources)


def multi_tensor_adam(chunk_size, noop_flag, grads, params, exp_avgs, exp_avg_sqs,
                      lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay):
    if not params or _skip(noop_flag):
        return
    if mode not in (0, 1):
        raise ValueError(f"multi_tensor_adam: mode must be 0 (Adam, L2) or 1 (AdamW), got {mode}")
    (grads, params, exp_avgs, exp_avg_sqs), writeback = _in_fp32(grads, params, exp_avgs, exp_avg_sqs)

    bias_correction1 = 1.0 - beta1 ** step if bias_correction == 1 else 1.0
    bias_correction2 = 1.0 - beta2 ** step if bias_correction == 1 else 1.0

    if mode == 0 and weight_decay != 0:
        # L2: the decay joins the gradient the moments see; the caller's grads stay untouched.
        grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

    # sqrt(v / bc2) + eps, built in place on one fresh list.
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bias_correction2))
    torch._foreach_add_(denom, epsilon)

    if mode == 1 and weight_decay != 0:
        # Decoupled decay uses the pre-step parameter, so apply it before the Adam update.
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bias_correction1)
    _write_back(writeback)


def multi_tensor_lion(chunk_size, noop_flag, grads, params, exp_avgs, lr, beta1, beta2, step, weight_decay):
    if not params or _skip(noop_flag):
        return
    (grads, params, exp_avgs), writeback = _in_fp32(grads, params, exp_avgs)

    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    # +1 where c > 0, -1 elsewhere (zero included): sign(sign(c) - 0.5).
    torch._foreach_sign_(direction)
    torch._foreach_sub_(direction, 0.5)
    torch._foreach_sign_(direction)

    if weight_decay != 0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
    _write_back(writeback)


def _no_output(*_):
    return None


KERNELS = {
    "multi_tensor_adam": multi_tensor_adam,
    "multi_tensor_lion": multi_tensor_lion,
}

FAKES = {
    "multi_tensor_adam": _no_output,
    "multi_tensor_lion": _no_output,
}
