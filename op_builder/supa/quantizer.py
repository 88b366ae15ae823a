"""QuantizerBuilder: DeepSpeed's quantizer ops (ZeRO++ quantized weights/gradients) as torch_supa_ext operators.

Besides the current API (`quantize`, `dequantize`, `swizzle_quant`, ...) DeepSpeed's older
quantizer called per-dtype functions (`ds_quantize_fp16`, `ds_sr_quantize_asym_fp32`, ...);
torch_supa_ext merged those into one operator each (`ds_quantize`, `ds_sr_quantize_asym`).
"""

from . import builder

_CURRENT = ('quantize', 'dequantize', 'dequantize_fp32', 'dequantize_int4_to_half_experimental',
            'dequantize_int8_to_half_experimental', 'swizzle_quant', 'quantized_reduction', 'loco_swizzle_quant',
            'loco_quantized_reduction')
_MERGED = ('ds_quantize', 'ds_quantize_asym', 'ds_sr_quantize', 'ds_sr_quantize_asym')


def _ops():
    table = {name: name for name in _CURRENT + _MERGED}
    table.update({f'{name}_{dtype}': name for name in _MERGED for dtype in ('fp32', 'fp16', 'bf16')})
    return table


class QuantizerBuilder(builder.SUPAExtensionOpBuilder):
    BUILD_VAR = "DS_BUILD_QUANTIZER"
    NAME = "quantizer"
    OPS = _ops()

    def absolute_name(self):
        return f'deepspeed.ops.quantizer.{self.NAME}_op'

    def constants(self):
        # DeepSpeed passes quantizer_module.Symmetric / .Asymmetric as the int quant_type argument;
        # values of the C++ enum quantize::Type.
        return {'Symmetric': 0, 'Asymmetric': 1}
