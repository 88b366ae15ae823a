"""Reference kernels for the quantization ops that have SUPA kernels.

Groups are contiguous runs of ``numel / groups`` elements in flat order. Rounding is
round-half-to-even (the CUDA kernels' ``__float2int_rn``). Meanings follow DeepSpeed:
- quantize(x, groups, bits, type) -> [q int8, params fp32 [groups, 1|2]]
  symmetric (type 0): ``scale = 2**bits / (2*absmax)`` (1 when absmax is 0),
  ``q = clamp(round(x*scale), -2**(bits-1), 2**(bits-1)-1)``, params = ``1/scale``;
  asymmetric (type 1): ``scale = 2**bits / (max-min)`` (1 when equal), ``offset = (max+min)/2``,
  ``q = clamp(round((x-offset)*scale))``, params = ``(1/scale, offset)``.
  4-bit codes are packed two per byte along the last dimension, the earlier element in the
  high nibble.
- dequantize / dequantize_fp32: ``q * params[0] (+ params[1])`` as fp16 / fp32.
- ds_quantize / ds_quantize_asym: in-place fake quantization (quantize then dequantize):
  symmetric with ``scale = 2**bits / (2*absmax + 1e-5)`` and the same clamp; asymmetric with
  step ``(max - min + 1e-5) / 2**bits`` from ``min``, unclamped as in DeepSpeed.
- dequantize_int{4,8}_to_half_experimental: unsigned codes (int4: two per byte, high nibble
  first), ``q / scale[group] + min[group]`` as fp16 of shape [num_group, group_size].
"""

import torch

SYMMETRIC = 0
ASYMMETRIC = 1


def _check_bits(op, bits):
    if bits not in (4, 8):
        raise ValueError(f"{op}: num_bits must be 4 or 8, got {bits}")


def _check_type(op, quant_type):
    if quant_type not in (SYMMETRIC, ASYMMETRIC):
        raise ValueError(f"{op}: quant_type must be 0 (symmetric) or 1 (asymmetric), got {quant_type}")


def _grouped(t, groups, op):
    if groups <= 0 or t.numel() % groups:
        raise ValueError(f"{op}: {t.numel()} elements do not split into {groups} groups")
    return t.reshape(groups, -1)


def _pack_int4(q, shape):
    # q: int32 codes in [-8, 7], flat order of `shape`; pairs along the last dimension.
    pairs = q.reshape(*shape[:-1], shape[-1] // 2, 2)
    packed = (pairs[..., 0] & 0xF) * 16 + (pairs[..., 1] & 0xF)
    return torch.where(packed > 127, packed - 256, packed).to(torch.int8)


def _unpack_int4(data, signed):
    wide = data.to(torch.int32) & 0xFF
    high, low = wide // 16, wide & 0xF
    if signed:
        high = torch.where(high > 7, high - 16, high)
        low = torch.where(low > 7, low - 16, low)
    return torch.stack((high, low), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)


def quantize(input_vals, groups, numBits, quantType):
    _check_bits("quantize", numBits)
    _check_type("quantize", quantType)
    if numBits == 4 and input_vals.shape[-1] % 2:
        raise ValueError("quantize: 4-bit packing needs an even last dimension")
    x = _grouped(input_vals.float(), groups, "quantize")
    levels = float(1 << numBits)
    q_min, q_max = -(1 << (numBits - 1)), (1 << (numBits - 1)) - 1
    if quantType == SYMMETRIC:
        absmax = x.abs().amax(dim=1, keepdim=True)
        scale = torch.where(absmax == 0, torch.ones_like(absmax), levels / (2 * absmax))
        q = torch.round(x * scale)
        params = 1.0 / scale
    else:
        hi, lo = x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True)
        scale = torch.where(hi == lo, torch.ones_like(hi), levels / (hi - lo))
        offset = (hi + lo) / 2
        q = torch.round((x - offset) * scale)
        params = torch.cat((1.0 / scale, offset), dim=1)
    q = q.clamp_(q_min, q_max).to(torch.int32)
    if numBits == 8:
        out = q.to(torch.int8).reshape(input_vals.shape)
    else:
        out = _pack_int4(q, input_vals.shape)
    return [out, params.contiguous()]


def _dequantize(quantized_data, params, groups, num_bits, quant_type, dtype, op):
    _check_bits(op, num_bits)
    _check_type(op, quant_type)
    q = quantized_data.to(torch.int32) if num_bits == 8 else _unpack_int4(quantized_data, signed=True)
    values = _grouped(q.float(), groups, op)
    per_group = params.float().reshape(groups, -1)
    values = values * per_group[:, :1]
    if quant_type == ASYMMETRIC:
        values = values + per_group[:, 1:2]
    return values.reshape(q.shape).to(dtype)


def dequantize(quantized_data, params, groups, num_bits, quant_type):
    return _dequantize(quantized_data, params, groups, num_bits, quant_type, torch.float16, "dequantize")


def dequantize_fp32(quantized_data, params, groups, num_bits, quant_type):
    return _dequantize(quantized_data, params, groups, num_bits, quant_type, torch.float32, "dequantize_fp32")


def ds_quantize(vals, groups, bits):
    x = _grouped(vals.float(), groups, "ds_quantize")
    scale = float(1 << bits) / (2 * x.abs().amax(dim=1, keepdim=True) + 1e-5)
    q = torch.round(x * scale).clamp_(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    vals.copy_((q * (1.0 / scale)).reshape(vals.shape))
    return vals


def ds_quantize_asym(vals, groups, bits):
    x = _grouped(vals.float(), groups, "ds_quantize_asym")
    lo = x.amin(dim=1, keepdim=True)
    step = (x.amax(dim=1, keepdim=True) - lo + 1e-5) / float(1 << bits)
    q = torch.round((x - lo) * (1.0 / step))
    vals.copy_((q * step + lo).reshape(vals.shape))
    return vals


def _dequantize_experimental(codes, scale_buffer, min_val_buffer, num_group, group_size):
    values = codes.float().reshape(num_group, group_size)
    scale = scale_buffer.float().reshape(num_group, 1)
    minimum = min_val_buffer.float().reshape(num_group, 1)
    return (values / scale + minimum).to(torch.float16)


def dequantize_int4_to_half_experimental(data_in, scale_buffer, min_val_buffer, num_group, group_size):
    codes = _unpack_int4(data_in.reshape(-1), signed=False)
    return _dequantize_experimental(codes, scale_buffer, min_val_buffer, num_group, group_size)


def dequantize_int8_to_half_experimental(data_in, scale_buffer, min_val_buffer, num_group, group_size):
    codes = data_in.reshape(-1).to(torch.int32) & 0xFF
    return _dequantize_experimental(codes, scale_buffer, min_val_buffer, num_group, group_size)


def _fake_quantize(input_vals, groups, numBits, quantType):
    shape = list(input_vals.shape)
    if numBits != 8:
        shape[-1] //= 2
    params = input_vals.new_empty((groups, 2 if quantType == ASYMMETRIC else 1), dtype=torch.float32)
    return [input_vals.new_empty(shape, dtype=torch.int8), params]


def _fake_dequantize(dtype):
    def fake(quantized_data, params, groups, num_bits, quant_type):
        shape = list(quantized_data.shape)
        if num_bits != 8:
            shape[-1] *= 2
        return quantized_data.new_empty(shape, dtype=dtype)
    return fake


def _fake_experimental(data_in, scale_buffer, min_val_buffer, num_group, group_size):
    return data_in.new_empty((num_group, group_size), dtype=torch.float16)


KERNELS = {
    "ds_quantize": ds_quantize,
    "ds_quantize_asym": ds_quantize_asym,
    "quantize": quantize,
    "dequantize": dequantize,
    "dequantize_fp32": dequantize_fp32,
    "dequantize_int4_to_half_experimental": dequantize_int4_to_half_experimental,
    "dequantize_int8_to_half_experimental": dequantize_int8_to_half_experimental,
}

FAKES = {
    # In-place ops return their (aliased) argument, as the schema's Tensor(a!) says.
    "ds_quantize": lambda vals, groups, bits: vals,
    "ds_quantize_asym": lambda vals, groups, bits: vals,
    "quantize": _fake_quantize,
    "dequantize": _fake_dequantize(torch.float16),
    "dequantize_fp32": _fake_dequantize(torch.float32),
    "dequantize_int4_to_half_experimental": _fake_experimental,
    "dequantize_int8_to_half_experimental": _fake_experimental,
}
