"""InferenceBuilder: DeepSpeed's transformer-inference ops (op_binding/*) as torch_supa_ext operators.

DeepSpeed calls per-dtype functions (`softmax_fp16`, `qkv_gemm_bf16`, ...); torch_supa_ext
2.12.0a1 registers one operator per family (`softmax`, `qkv_gemm`) with the same arguments. Names
with no operator (`add_padding_*`, `repeat_kv_cache_*`, the inference `dequantize_*`, whose
arguments differ from the quantizer's `dequantize`) raise an AttributeError naming them, which
DeepSpeed's op bindings answer with their own PyTorch fallback.
"""

from . import builder

_DTYPES = ('fp32', 'fp16', 'bf16')

# DeepSpeed function family -> torch_supa_ext operator (None: not provided by torch_supa_ext).
_PER_DTYPE = {
    'softmax': 'softmax',
    'softmax_context': 'softmax_context',
    'bias_gelu': 'bias_gelu',
    'bias_add': 'bias_add',
    'bias_relu': 'bias_relu',
    'bias_residual': 'bias_residual',
    'qkv_gemm': 'qkv_gemm',
    'rms_qkv_gemm': 'rms_qkv_gemm',
    'mlp_gemm': 'mlp_gemm',
    'rms_mlp_gemm': 'rms_mlp_gemm',
    'vector_matmul': 'vector_matmul',
    'linear_layer': 'linear_layer',
    'fused_gemm_gelu': 'fused_gemm_gelu',
    'residual_add_bias': 'residual_add_bias',
    'einsum_sec_sm_ecm': 'einsum_sec_sm_ecm',
    'pad_transform': 'pad_transform',
    'allocate_workspace': 'allocate_workspace',
    'layer_norm': 'layer_norm',
    'add_padding': None,
    'repeat_kv_cache': None,
    'dequantize': None,
}

_UNSUFFIXED = {
    'softmax_context_int8': 'softmax_context_int8',
    'gated_activation': 'gated_activation',
    'layer_norm': 'layer_norm',
    '_layer_norm_residual': '_layer_norm_residual',
    'layer_norm_residual_store_pre_ln_res': 'layer_norm_residual_store_pre_ln_res',
    'rms_norm': 'rms_norm',
    'pre_rms_norm': 'pre_rms_norm',
    '_vector_add': '_vector_add',
    'apply_rotary_pos_emb': 'apply_rotary_pos_emb',
    'moe_res_matmul': 'moe_res_matmul',
    'reset_cache': 'reset_cache',
    'release_workspace': 'release_workspace',
    'retake_workspace': 'retake_workspace',
    # int8 entry points DeepSpeed's bindings ask for; no operator has these semantics.
    'vector_matmul_int8': None,
    'fused_gemm_gelu_int8': None,
}


def _ops():
    table = {f'{family}_{dtype}': op for family, op in _PER_DTYPE.items() for dtype in _DTYPES}
    table.update(_UNSUFFIXED)
    return table


class InferenceBuilder(builder.SUPAExtensionOpBuilder):
    BUILD_VAR = "DS_BUILD_TRANSFORMER_INFERENCE"
    NAME = "transformer_inference"
    OPS = _ops()

    def absolute_name(self):
        return f'deepspeed.ops.transformer.inference.{self.NAME}_op'
