"""What one operator launched on the card costs: its FLOPs and the bytes it reads and writes.

The operator stream (op_stream.py) gives each launch as (name, inputs, outputs), a tensor as
(dtype name, device type, sizes). Matrix products, convolutions and attention are counted in
FLOPs (a multiply-add is 2); every launch is also counted in the bytes of its supa operands and
results, which bounds the operators that do little arithmetic per byte. Views, allocations and
metadata launch nothing and cost nothing. Attention is counted as the fused kernels count it: a
causal mask halves the score and value products (the kernels skip the masked blocks), and the
backward pass is 2.5 times the forward (five products of the forward's size where the forward has
two: FlashAttention's own accounting).
"""

import dataclasses
import functools
import math
from typing import Optional

import torch

SUPA = 1  # device type code of a tensor in the stream (0: CPU, 2: other)

_ITEM_SIZE = {
    "Double": 8, "Float": 4, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1, "Byte": 1,
    "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "ComplexHalf": 4, "UInt16": 2, "UInt32": 4, "UInt64": 8,
}

# The card's throughput a dtype runs at (card_profiles.DTYPE_FAMILIES). float32 products run in
# fp32: PyTorch's default keeps TF32 off for matrix products.
_FAMILY = {"BFloat16": "bf16", "Half": "fp16", "Char": "int8", "Byte": "int8"}


@dataclasses.dataclass(frozen=True)
class OpCost:
    kind: str  # "gemm", "conv", "attention_forward", "attention_backward", "memory", "h2d", "d2h", "none"
    flops: float
    bytes: float
    family: str  # the dtype family whose peak applies
    host_waits: bool = False  # the host waits for this launch to complete (a copy to the host, .item())


NONE = OpCost("none", 0.0, 0.0, "fp32")


def _is_tensor(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str)


def _tensors(args):
    for x in args:
        if _is_tensor(x):
            yield x
        elif isinstance(x, list):
            yield from _tensors(x)


def _numel(t) -> int:
    return math.prod(t[2])


def _nbytes(t) -> int:
    return _numel(t) * _ITEM_SIZE.get(t[0], 4)


def family_of(dtype: str) -> str:
    return _FAMILY.get(dtype, "fp32")


@functools.lru_cache(maxsize=None)
def _launches_nothing(name: str) -> bool:
    """Views (every result aliases an operand without writing it), allocations and metadata."""
    if name in _NO_LAUNCH:
        return True
    base, _, overload = name.partition(".")
    try:
        schema = torch._C._get_schema(base, overload)
    except RuntimeError:
        return False
    returns = schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


_NO_LAUNCH = {
    "aten::empty.memory_format", "aten::empty_strided", "aten::empty_like", "aten::resize_",
    "aten::set_.source_Storage",
    "aten::set_.source_Storage_storage_offset", "aten::set_.source_Tensor", "aten::set_", "aten::record_stream",
    "aten::lift_fresh", "aten::_has_compatible_shallow_copy_type", "aten::is_pinned", "aten::_pin_memory",
}


# In-place operators that write their first operand without reading it.
_WRITES_ONLY = {"aten::copy_", "aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_", "aten::random_",
                "aten::bernoulli_", "aten::exponential_", "aten::geometric_", "aten::log_normal_", "aten::cauchy_"}


def _matmul_flops(name: str, ins) -> Optional[float]:
    base = name.split(".")[0]
    t = list(_tensors(ins))
    if base in ("aten::mm", "aten::_scaled_mm") and len(t) >= 2:
        (m, k), (_, n) = t[0][2][-2:], t[1][2][-2:]
        return 2.0 * m * k * n
    if base in ("aten::addmm", "aten::_addmm_activation") and len(t) >= 3:
        (m, k), (_, n) = t[1][2][-2:], t[2][2][-2:]
        return 2.0 * m * k * n
    if base == "aten::bmm" and len(t) >= 2:
        b, m, k = t[0][2]
        return 2.0 * b * m * k * t[1][2][-1]
    if base == "aten::baddbmm" and len(t) >= 3:
        b, m, k = t[1][2]
        return 2.0 * b * m * k * t[2][2][-1]
    if base in ("aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::addr", "aten::ger", "aten::outer"):
        return 2.0 * max((_numel(x) for x in t), default=0)
    return None


def _conv_flops(name: str, ins, outs) -> Optional[float]:
    base = name.split(".")[0]
    if "conv" not in base or "backward" in base and "convolution_backward" not in base:
        return None
    t = [x for x in ins if _is_tensor(x) or x is None]
    if "convolution_backward" in base:
        # (grad_output, input, weight, ..., output_mask): each asked-for gradient is one forward's FLOPs
        grad_out, weight = t[0], t[2]
        forward = 2.0 * _numel(grad_out) * math.prod(weight[2][1:])
        mask = ins[-1] if isinstance(ins[-1], list) else [True, True, True]
        return forward * sum(1 for m in mask[:2] if m)
    if len(t) < 2 or t[1] is None or len(t[1][2]) < 3:
        return None
    inp, weight = t[0], t[1]
    out = next(_tensors(outs), None)
    if out is None:
        return None
    # convolution(input, weight, bias, stride, padding, dilation, transposed, ...)
    transposed = any(x is True for x in ins[6:7])
    per_output = math.prod(weight[2][1:])
    return 2.0 * (_numel(inp) if transposed else _numel(out)) * per_output


_ATTENTION = {
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention_backward", "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_flash_attention_forward",
    "aten::_flash_attention_backward", "aten::_efficient_attention_forward", "aten::_efficient_attention_backward",
}
# (batch, seq, heads, dim) operands; the others are (batch, heads, seq, dim)
_SEQ_BEFORE_HEADS = {"aten::_flash_attention_forward", "aten::_flash_attention_backward",
                     "aten::_efficient_attention_forward", "aten::_efficient_attention_backward"}


@functools.lru_cache(maxsize=None)
def _causal_argument(base: str) -> tuple:
    """(position, what marks causal) of an attention operator's causal flag, from its schema:
    is_causal/causal True, or the memory-efficient kernels' custom_mask_type 1 or 2 (causal from
    the top left or the bottom right)."""
    names = [a.name for a in torch._C._get_schema(base, "").arguments]
    for flag in ("is_causal", "causal"):
        if flag in names:
            return names.index(flag), (True,)
    return (names.index("custom_mask_type"), (1, 2)) if "custom_mask_type" in names else (-1, ())


BACKWARD_FACTOR = 2.5


def attention_flops(q, k, v, causal: bool) -> float:
    """Forward FLOPs of attention over (batch, heads, seq, dim) q, k, v (grouped heads: q's heads)."""
    *lead, s_q, d = q
    s_k, d_v = k[-2], v[-1]
    products = 2.0 * math.prod(lead) * s_q * s_k * (d + d_v)
    return products / 2 if causal and s_q == s_k else products


def _attention(name: str, ins) -> Optional[OpCost]:
    base = name.split(".")[0]
    if base not in _ATTENTION:
        return None
    backward = base.endswith("_backward")
    t = [x for x in ins if _is_tensor(x)]
    q, k, v = t[1:4] if backward else t[0:3]
    if base in _SEQ_BEFORE_HEADS:
        q, k, v = [(x[0], x[1], (x[2][0], x[2][2], x[2][1], x[2][3])) for x in (q, k, v)]
    at, marks = _causal_argument(base)
    causal = 0 <= at < len(ins) and ins[at] in marks
    if base == "aten::scaled_dot_product_attention" and len(ins) > 3 and ins[3] is not None:
        causal = False  # an explicit mask: every block is computed
    flops = attention_flops(q[2], k[2], v[2], causal)
    kind = "attention_backward" if backward else "attention_forward"
    return OpCost(kind, flops * (BACKWARD_FACTOR if backward else 1.0), 0.0, family_of(q[0]))


def cost(name: str, ins, outs) -> OpCost:
    """The cost of one launch of `name` with these operands and results."""
    if _launches_nothing(name):
        return NONE
    written = sum(_nbytes(t) for t in _tensors(outs) if t[1] == SUPA)
    supa_bytes = sum(_nbytes(t) for t in _tensors(ins) if t[1] == SUPA) + written
    base_name, _, overload = name.partition(".")
    if base_name in _WRITES_ONLY or overload.startswith("out"):
        supa_bytes -= written  # the result is an operand the kernel writes without reading it
    host_bytes = sum(_nbytes(t) for t in _tensors(ins) if t[1] != SUPA) + \
        sum(_nbytes(t) for t in _tensors(outs) if t[1] != SUPA)
    base = name.split(".")[0]
    if base == "aten::_local_scalar_dense":  # .item(): the value crosses to the host, which waits for it
        return OpCost("d2h", 0.0, float(supa_bytes), "fp32", host_waits=True)
    if base in ("aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize") and host_bytes:
        to_host = any(t[1] != SUPA for t in _tensors(outs))  # copy_'s result is its destination
        non_blocking = base in ("aten::copy_", "aten::_copy_from") and any(x is True for x in ins[2:3])
        moved = min(supa_bytes, host_bytes) if to_host else host_bytes
        return OpCost("d2h" if to_host else "h2d", 0.0, float(moved), "fp32", host_waits=to_host and not non_blocking)
    dtype = next((t[0] for t in _tensors(ins) if t[1] == SUPA), "Float")
    attention = _attention(name, ins)
    if attention is not None:
        return dataclasses.replace(attention, bytes=float(supa_bytes))
    flops = _matmul_flops(name, ins)
    if flops is not None:
        return OpCost("gemm", flops, float(supa_bytes), family_of(dtype))
    flops = _conv_flops(name, ins, outs)
    if flops is not None:
        return OpCost("conv", flops, float(supa_bytes), family_of(dtype))
    return OpCost("memory", 0.0, float(supa_bytes), family_of(dtype))
