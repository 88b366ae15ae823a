"""Reference kernels for the bias, activation and residual ops that have SUPA kernels.

Meanings follow DeepSpeed's inference and spatial kernels (math in fp32, result in the input's
dtype, bias broadcast along the last dimension unless stated):
- bias_add / bias_relu / bias_gelu: ``act(x + b)``; bias_gelu uses the tanh GeLU approximation.
- bias_residual: ``x + residual (+ b)``; a one-element bias means "no bias" (DeepSpeed's MoE
  path passes ``torch.empty(1)`` there).
- gated_activation: ``[..., 2C] -> [..., C]``, ``(h + b_h) * act(g + b_g)`` where the second
  half of the channels gates the first; type 3 = GeLU (erf), 4 = SiLU.
- nhwc_bias_add(_add, _bias_add): ``x + b (+ other (+ other_bias))`` per channel, for NCHW
  tensors in channels-last memory (channel dim 1) or ``[B, S, C]``; the layout is preserved.
- _vector_add: ``gamma * a + b``.
- moe_res_matmul: ``output = output * coef[C:2C] + moe_res * coef[:C]`` written into ``output``
  and returned: DeepSpeed's MoE layer ignores the return value and relies on the in-place write.
- residual_add_bias: updates ``residual`` in place (the schema's ``Tensor(a!)``), with the three
  layouts DeepSpeed distinguishes (pre/post layer norm with MLP after attention, GPT-J style).
"""

import torch

from .precision import upcast

GATED_GELU = 3
GATED_SILU = 4


def _channel_bias(bias, width):
    return upcast(bias).reshape(width)


def _bias_act(activation, bias, act):
    width = activation.shape[-1]
    return act(upcast(activation) + _channel_bias(bias, width)).to(activation.dtype)


def bias_add(activation, bias):
    return _bias_act(activation, bias, lambda x: x)


def bias_relu(activation, bias):
    return _bias_act(activation, bias, torch.relu)


def bias_gelu(activation, bias):
    return _bias_act(activation, bias, lambda x: torch.nn.functional.gelu(x, approximate="tanh"))


def bias_residual(output, bias, residual):
    total = upcast(output) + upcast(residual)
    if bias.numel() > 1:
        total = total + _channel_bias(bias, output.shape[-1])
    return total.to(output.dtype)


def gated_activation(activation, bias, activation_func_type):
    if activation_func_type == GATED_GELU:
        gate_fn = torch.nn.functional.gelu
    elif activation_func_type == GATED_SILU:
        gate_fn = torch.nn.functional.silu
    else:
        raise ValueError("gated_activation: activation_func_type must be 3 (GATED_GELU) or "
                         f"4 (GATED_SILU), got {activation_func_type}")
    channels = activation.shape[-1]
    if channels % 2:
        raise ValueError(f"gated_activation: the last dimension must be even, got {channels}")
    hidden, gate = (upcast(activation) + _channel_bias(bias, channels)).chunk(2, dim=-1)
    return (hidden * gate_fn(gate)).to(activation.dtype)


def _nhwc_channel_shape(input):
    # 4-D tensors are NCHW in channels-last memory: channels on dim 1. 3-D: [B, S, C].
    if input.dim() == 4:
        return (1, input.shape[1], 1, 1)
    return (input.shape[-1],)


def _nhwc_sum(input, *terms):
    shape = _nhwc_channel_shape(input)
    total = upcast(input)
    for term, is_bias in terms:
        total = total + (upcast(term).reshape(shape) if is_bias else upcast(term))
    return total.to(input.dtype)


def nhwc_bias_add(input, bias):
    return _nhwc_sum(input, (bias, True))


def nhwc_bias_add_add(input, bias, other):
    return _nhwc_sum(input, (bias, True), (other, False))


def nhwc_bias_add_bias_add(input, bias, other, other_bias):
    return _nhwc_sum(input, (bias, True), (other, False), (other_bias, True))


def vector_add(a, b, gamma):
    return (gamma * upcast(a) + upcast(b)).to(a.dtype)


def moe_res_matmul(moe_res, coef, output):
    width = moe_res.shape[-1]
    coefs = upcast(coef).reshape(-1)
    res_coef, out_coef = coefs[:width], coefs[width:2 * width]
    output.copy_(upcast(output) * out_coef + upcast(moe_res) * res_coef)
    return output


def residual_add_bias(hidden_state, residual, attention_output, attention_bias, final_bias,
                      mp_size, mlp_after_attn, add_bias, pre_layer_norm):
    width = residual.shape[-1]
    scale = 1.0 / mp_size
    res, hidden = upcast(residual), upcast(hidden_state)

    def bias(t):
        return _channel_bias(t, width)

    if mlp_after_attn and pre_layer_norm:
        new = (res + upcast(attention_output) + bias(attention_bias) + bias(final_bias)) * scale + hidden
    elif mlp_after_attn:
        new = res + hidden + bias(final_bias)
    else:
        # GPT-J style: attention and MLP run in parallel on the same input.
        carried = res + bias(final_bias)
        if add_bias:
            carried = carried + bias(attention_bias)
        new = hidden + upcast(attention_output) + carried * scale
    residual.copy_(new)


def _like(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _gated_shape(activation, bias, activation_func_type):
    return activation.new_empty((*activation.shape[:-1], activation.shape[-1] // 2))


KERNELS = {
    "bias_add": bias_add,
    "bias_relu": bias_relu,
    "bias_gelu": bias_gelu,
    "bias_residual": bias_residual,
    "gated_activation": gated_activation,
    "nhwc_bias_add": nhwc_bias_add,
    "nhwc_bias_add_add": nhwc_bias_add_add,
    "nhwc_bias_add_bias_add": nhwc_bias_add_bias_add,
    "_vector_add": vector_add,
    "moe_res_matmul": moe_res_matmul,
    "residual_add_bias": residual_add_bias,
}

FAKES = {
    "bias_add": lambda activation, bias: _like(activation),
    "bias_relu": lambda activation, bias: _like(activation),
    "bias_gelu": lambda activation, bias: _like(activation),
    "bias_residual": lambda output, bias, residual: _like(output),
    "gated_activation": _gated_shape,
    # empty_like keeps the channels-last layout, as the kernels' outputs do.
    "nhwc_bias_add": lambda input, *_: torch.empty_like(input),
    "nhwc_bias_add_add": lambda input, *_: torch.empty_like(input),
    "nhwc_bias_add_bias_add": lambda input, *_: torch.empty_like(input),
    "_vector_add": lambda a, b, gamma: _like(a),
    # A fake may not alias its inputs; the shape is what tracing needs.
    "moe_res_matmul": lambda moe_res, coef, output: _like(output),
    "residual_add_bias": lambda *_: None,
}
