"""FusedLambBuilder: DeepSpeed's per-tensor `lamb` on SUPA (compiled kernel if it works, else PyTorch).

torch_supa_ext 2.12.0a1 registers `deepspeed::lamb` as a stub, so the probe normally picks the
fallback. Semantics (those of DeepSpeed's kernel), in fp32 arithmetic:
  g = g / grad_scale
  m = beta1 * m + (1 - beta1) * g ;  v = beta2 * v + (1 - beta2) * g * g
  denom = sqrt(v + eps) (mode 0) or sqrt(v) + eps (mode 1)
  update = m / denom + decay * p
  coeff = clamp(|p| / |update|, min_coeff, max_coeff), or 1 when either norm is 0
  p -= step_size * coeff * update,  step_size = lr * sqrt(bc2) / bc1 (bc_i = 1 - beta_i**step) or lr
  p_copy (when non-empty and the gradient is 16-bit) receives the new p
Returns coeff as a one-element tensor.
"""

import torch

from . import builder, multi_tensor, supa_kernels


def _probe_ext_kernel(op, device):
    z = lambda: torch.zeros(4, device=device)  # noqa: E731
    op(torch.ones(4, device=device), torch.empty(0, device=device), z(), z(), torch.ones(4, device=device), 1e-3,
       0.9, 0.999, 10.0, 0.01, 1e-8, 1.0, 1, 1, 1, 0.0)


def lamb_fallback(p, p_copy, m, v, g, lr, beta1, beta2, max_coeff, min_coeff, eps, grad_scale, step, mode,
                  bias_correction, decay):
    (p32, ), (m32, ), (v32, ), (g32, ) = (multi_tensor.as_fp32([t]) for t in (p, m, v, g))
    g32 = g32 / grad_scale
    m32.mul_(beta1).add_(g32, alpha=1 - beta1)
    v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    denom = (v32 + eps).sqrt_() if mode == 0 else v32.sqrt().add_(eps)
    update = m32 / denom
    if decay != 0:
        update.add_(p32, alpha=decay)
    w_norm = torch.linalg.vector_norm(p32)
    u_norm = torch.linalg.vector_norm(update)
    # Stays on the device: no host round trip to decide the clamp.
    coeff = torch.where((w_norm != 0) & (u_norm != 0), (w_norm / u_norm).clamp(min_coeff, max_coeff),
                        torch.ones_like(w_norm))
    if bias_correction:
        step_size = lr * (1 - beta2**step)**0.5 / (1 - beta1**step)
    else:
        step_size = lr
    p32.sub_(update.mul_(coeff * step_size))
    for dst, src in ((p, p32), (m, m32), (v, v32)):
        multi_tensor.store([dst], [src])
    if p_copy.numel() > 0 and g.dtype in multi_tensor.LOW_PRECISION:
        p_copy.copy_(p32)
    coeff_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    return coeff.reshape(1).to(coeff_dtype)


@torch.no_grad()  # DeepSpeed hands over bf16 Parameters themselves, outside no_grad
def lamb(p, p_copy, m, v, g, lr, beta1, beta2, max_coeff, min_coeff, eps, grad_scale, step, mode, bias_correction,
         decay):
    kernel = supa_kernels.usable_kernel('lamb', p.device, _probe_ext_kernel)
    impl = kernel if kernel is not None else lamb_fallback
    return impl(p, p_copy, m, v, g, lr, beta1, beta2, max_coeff, min_coeff, eps, grad_scale, step, mode,
                bias_correction, decay)


class FusedLambBuilder(builder.SUPAPythonOpBuilder):
    BUILD_VAR = "DS_BUILD_FUSED_LAMB"
    NAME = "fused_lamb"

    def absolute_name(self):
        return f'deepspeed.ops.lamb.{self.NAME}_op'

    def ops(self):
        return {'lamb': lamb}
