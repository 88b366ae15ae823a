"""Reference kernels for the layer-norm ops that have SUPA kernels: layer_norm and its residual variants.

Meaning, as in DeepSpeed's inference kernels: normalise each row of the last dimension with the
biased variance, ``(x - mean) * rsqrt(var + eps) * gamma + beta``; the residual variants first
form ``input + bias + residual`` (bias broadcast along rows) and normalise that sum.
"""

import torch

from .precision import upcast


def _normalize(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, epsilon: float) -> torch.Tensor:
    # x is already in the compute dtype; the result keeps that dtype.
    width = x.shape[-1]
    return torch.nn.functional.layer_norm(x, (width,), upcast(gamma).reshape(width),
                                          upcast(beta).reshape(width), epsilon)


def _pre_ln_sum(input, bias, residual):
    # The sum is stored in the input's dtype before it is normalised (DeepSpeed rounds it
    # through the storage type too), so normalising the rounded value matches the kernel.
    width = input.shape[-1]
    total = upcast(input) + upcast(bias).reshape(width) + upcast(residual)
    return total.to(input.dtype)


def layer_norm(input, gamma, beta, epsilon):
    return _normalize(upcast(input), gamma, beta, epsilon).to(input.dtype)


def layer_norm_residual(input, bias, residual, gamma, beta, epsilon):
    pre_ln = _pre_ln_sum(input, bias, residual)
    return _normalize(upcast(pre_ln), gamma, beta, epsilon).to(input.dtype)


def layer_norm_residual_store_pre_ln_res(input, bias, residual, gamma, beta, epsilon):
    pre_ln = _pre_ln_sum(input, bias, residual)
    return _normalize(upcast(pre_ln), gamma, beta, epsilon).to(input.dtype), pre_ln


def _like_input(input, *_):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _pair_like_input(input, *_):
    return _like_input(input), _like_input(input)


KERNELS = {
    "layer_norm": layer_norm,
    "_layer_norm_residual": layer_norm_residual,
    "layer_norm_residual_store_pre_ln_res": layer_norm_residual_store_pre_ln_res,
}

FAKES = {
    "layer_norm": _like_input,
    "_layer_norm_residual": _like_input,
    "layer_norm_residual_store_pre_ln_res": _pair_like_input,
}
