"""Operator schemas of torch_supa_ext 2.12.0a1: the tables the emulated package registers.

The strings are the real package's schemas verbatim, read from its published wheel; the four
groups and their counts are described in docs/real_stack.md, "torch_supa_ext". Everything else
in this package is derived from them, so a schema is written down exactly once.
"""

# Namespaces as the real package names them.
DEEPSPEED_NAMESPACE = "deepspeed"
DC_NAMESPACE = "dc"

# Ops with kernels: compiled SUPA kernels in the real package (reference kernels here).
KERNEL_SCHEMAS = (
    "layer_norm(Tensor input, Tensor gamma, Tensor beta, float epsilon) -> Tensor",
    "_layer_norm_residual(Tensor input, Tensor bias, Tensor residual, Tensor gamma, Tensor beta, float epsilon) -> Tensor",
    "layer_norm_residual_store_pre_ln_res(Tensor input, Tensor bias, Tensor residual, Tensor gamma, Tensor beta, float epsilon) -> (Tensor, Tensor)",
    "multi_tensor_adam(int chunk_size, Tensor noop_flag, Tensor[] grads, Tensor[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, float lr, float beta1, float beta2, float epsilon, int step, int mode, int bias_correction, float weight_decay) -> ()",
    "multi_tensor_lion(int chunk_size, Tensor noop_flag, Tensor[] grads, Tensor[] params, Tensor[] exp_avgs, float lr, float beta1, float beta2, int step, float weight_decay) -> ()",
    "nhwc_bias_add(Tensor input, Tensor bias) -> Tensor",
    "nhwc_bias_add_add(Tensor input, Tensor bias, Tensor other) -> Tensor",
    "nhwc_bias_add_bias_add(Tensor input, Tensor bias, Tensor other, Tensor other_bias) -> Tensor",
    "bias_gelu(Tensor activation, Tensor bias) -> Tensor",
    "bias_add(Tensor activation, Tensor bias) -> Tensor",
    "bias_relu(Tensor activation, Tensor bias) -> Tensor",
    "bias_residual(Tensor output, Tensor bias, Tensor residual) -> Tensor",
    "gated_activation(Tensor activation, Tensor bias, int activation_func_type) -> Tensor",
    "_vector_add(Tensor a, Tensor b, float gamma) -> Tensor",
    "moe_res_matmul(Tensor moe_res, Tensor coef, Tensor output) -> Tensor",
    "residual_add_bias(Tensor hidden_state, Tensor(a!) residual, Tensor? attention_output, Tensor? attention_bias, Tensor? final_bias, int mp_size, bool mlp_after_attn, bool add_bias, bool pre_layer_norm) -> ()",
    "ds_quantize(Tensor(a!) vals, int groups, int bits) -> Tensor(a!)",
    "ds_quantize_asym(Tensor(a!) vals, int groups, int bits) -> Tensor(a!)",
    "quantize(Tensor input_vals, int groups, int numBits, int quantType) -> Tensor[]",
    "dequantize(Tensor quantized_data, Tensor params, int groups, int num_bits, int quant_type) -> Tensor",
    "dequantize_fp32(Tensor quantized_data, Tensor params, int groups, int num_bits, int quant_type) -> Tensor",
    "dequantize_int4_to_half_experimental(Tensor data_in, Tensor scale_buffer, Tensor min_val_buffer, int num_group, int group_size) -> Tensor",
    "dequantize_int8_to_half_experimental(Tensor data_in, Tensor scale_buffer, Tensor min_val_buffer, int num_group, int group_size) -> Tensor",
)

# Stub ops: deepspeed:: ops the real package registers as stubs raising NotImplementedError.
STUB_SCHEMAS = (
    "lamb(Tensor p, Tensor p_copy, Tensor m, Tensor v, Tensor g, float lr, float beta1, float beta2, float max_coeff, float min_coeff, float eps, float grad_scale, int step, int mode, int bias_correction, float decay) -> Tensor",
    "transformer_forward_fp32(int layer_id, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b, bool training_mode, bool prelayernorm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint) -> Tensor[]",
    "transformer_forward_fp16(int layer_id, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b, bool training_mode, bool prelayernorm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint) -> Tensor[]",
    "transformer_backward_fp32(int layer_id, Tensor grad_output, Tensor output, Tensor inp_norm, Tensor qkv_tf, Tensor soft_out, Tensor ctx_bufB, Tensor attn_o_inp, Tensor add_res, Tensor ff1_inp, Tensor gelu_inp, Tensor ff2_inp, Tensor attn_prob_dropout_mask, Tensor attn_output_dropout_mask, Tensor layer_output_dropout_mask, Tensor attn_layer_norm_var, Tensor attn_layer_norm_mean, Tensor layer_norm_var, Tensor layer_norm_mean, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b) -> Tensor[]",
    "transformer_backward_fp16(int layer_id, Tensor grad_output, Tensor output, Tensor inp_norm, Tensor qkv_tf, Tensor soft_out, Tensor ctx_bufB, Tensor attn_o_inp, Tensor add_res, Tensor ff1_inp, Tensor gelu_inp, Tensor ff2_inp, Tensor attn_prob_dropout_mask, Tensor attn_output_dropout_mask, Tensor layer_output_dropout_mask, Tensor attn_layer_norm_var, Tensor attn_layer_norm_mean, Tensor layer_norm_var, Tensor layer_norm_mean, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b) -> Tensor[]",
    "create_transformer_layer_fp32(int layer_id, int batch_size, int hidden_dim, int num_heads, int intermediate_size, float attn_dropout_ratio, float hidden_dropout_ratio, float layer_norm_eps, int seed, bool pre_or_postLayerNorm, bool test_gemm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint, bool stochastic_mode) -> int",
    "create_transformer_layer_fp16(int layer_id, int batch_size, int hidden_dim, int num_heads, int intermediate_size, float attn_dropout_ratio, float hidden_dropout_ratio, float layer_norm_eps, int seed, bool pre_or_postLayerNorm, bool test_gemm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint, bool stochastic_mode) -> int",
    "softmax(Tensor attn_scores, Tensor attn_mask, Tensor? alibi, bool triangular, bool recompute, bool local_attention, int window_size, bool async_op, float layer_scale, int head_offset, int mp_size) -> Tensor",
    "softmax_context(Tensor query_key_value, Tensor prev_key, Tensor new_key, Tensor attn_mask, Tensor prev_value, Tensor new_value, int heads, float norm_factor, bool merging, bool triangular, bool local_attention, int window_size, bool no_masking) -> (Tensor, Tensor, Tensor)",
    "softmax_context_int8(Tensor query_key_value, Tensor prev_key, Tensor new_key, Tensor attn_mask, Tensor prev_value, Tensor new_value, int heads, float norm_factor, bool merging, bool triangular, bool local_attention, int window_size, bool no_masking) -> (Tensor, Tensor, Tensor)",
    "qkv_gemm(Tensor input, Tensor weight, Tensor? q_scale, Tensor bias, Tensor gamma, Tensor beta, float eps, bool add_bias, bool q_int8, bool transpose) -> (Tensor, Tensor)",
    "rms_qkv_gemm(Tensor input, Tensor weight, Tensor? q_scale, Tensor gamma, float eps, bool q_int8, bool transpose) -> (Tensor, Tensor)",
    "mlp_gemm(Tensor input, Tensor residual, Tensor input_bias, Tensor weight_interm, Tensor weight_out, Tensor bias, Tensor gamma, Tensor beta, float eps, bool pre_layer_norm, bool mlp_after_attn, Tensor? q_scale, Tensor? q_scale1, bool q_int8, int activation_type, bool transpose) -> (Tensor, Tensor)",
    "rms_mlp_gemm(Tensor input, Tensor residual, Tensor weight_interm, Tensor weight_out, Tensor gamma, float eps, Tensor? interm_scale, Tensor? out_scale, int dtype, int mlp_act_func_type, bool transpose) -> (Tensor, Tensor)",
    "vector_matmul(Tensor input, Tensor weight, bool async_op, Tensor? q_scale, bool q_int8, bool transpose) -> Tensor",
    "linear_layer(Tensor input, Tensor weight, Tensor bias, bool add_bias, bool do_flash_attn, int num_heads, bool transpose, float rope_theta) -> Tensor",
    "fused_gemm_gelu(Tensor input, Tensor weight, Tensor? scale, Tensor bias, Tensor? out, Tensor? out_scale, int dtype, bool transpose) -> Tensor",
    "rms_norm(Tensor input, Tensor gamma, float epsilon) -> Tensor",
    "pre_rms_norm(Tensor input, Tensor residual, Tensor gamma, float epsilon) -> (Tensor, Tensor)",
    "apply_rotary_pos_emb(Tensor mixed_query, Tensor key_layer, int rotary_dim, int offset, int num_heads, bool rotate_half, float rope_theta) -> Tensor[]",
    "pad_transform(Tensor query, Tensor key, Tensor value, int heads, bool do_flash_attn) -> Tensor",
    "einsum_sec_sm_ecm(Tensor Q, Tensor W) -> Tensor",
    "allocate_workspace(int hidden_dim, int num_heads, int prompt_length, int batch_size, int num_layers, int mp_size, bool external_cache, int rank, int max_out_tokens, int min_out_tokens) -> ()",
    "release_workspace() -> ()",
    "retake_workspace() -> bool",
    "reset_cache() -> ()",
    "ds_sr_quantize(Tensor vals, int groups, int bits) -> Tensor",
    "ds_sr_quantize_asym(Tensor vals, int groups, int bits) -> Tensor",
    "swizzle_quant(Tensor input_vals, int groups, int num_bits, int quant_type, int pipeline_size, int nodes, int devices_per_node) -> Tensor[]",
    "quantized_reduction(Tensor input_vals, Tensor input_scales, int in_groups, int out_groups, int num_bits, int quant_type, int devices_per_node) -> Tensor[]",
    "loco_swizzle_quant(Tensor input_vals, Tensor error_feedback, float err_beta, int groups, int num_bits, int quant_type, int pipeline_size, int nodes, int devices_per_node) -> Tensor[]",
    "loco_quantized_reduction(Tensor input_vals, Tensor input_scales, Tensor error_feedback, float err_beta, int in_groups, int out_groups, int num_bits, int quant_type, int devices_per_node) -> Tensor[]",
    "fp_quantize(Tensor out, Tensor val, int group_size, int stochastic_rounding, int q_bits, int q_mantisa_bits) -> Tensor",
    "fp_dequantize(Tensor val, Tensor val_q, int group_size, int mantisa_bits, int exp_bits) -> ()",
    "fp_selective_dequantize(Tensor val, Tensor val_q, Tensor indexes, int group_size, int mantisa_bits, int exp_bits) -> ()",
    "attention(Tensor q, Tensor k, Tensor v, Tensor? bias1, Tensor? bias2, Tensor o, Tensor lse) -> ()",
    "attention_bwd(Tensor go, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor delta, Tensor? bias1, Tensor? bias2, Tensor gq, Tensor gk, Tensor gv, Tensor? gb1, Tensor? gb2) -> ()",
    "token_sort_(Tensor unsorted_token_ids, int original_tokens) -> Tensor",
    "token_gather(Tensor activations, Tensor sorted_indices, bool batch_first) -> Tensor",
    "token_scatter_(Tensor all_activations, Tensor layer_activations, Tensor sorted_indices, bool batch_first) -> Tensor",
    "mask_gather_bert(Tensor dense_mask, Tensor sorted_indices, int reserved_length) -> Tensor",
    "mask_gather_gpt(Tensor dense_mask, int truncated_seq_len) -> Tensor",
    "bias_activation_v2(Tensor activation, Tensor? bias, int act_func_type) -> Tensor",
    "blas_linear_v2(Tensor output, Tensor hidden_states, Tensor weights) -> Tensor",
    "blas_4d_matmul(Tensor output, Tensor A, Tensor B, bool is_bcast_b) -> Tensor",
    "layer_norm_v2(Tensor output_z, Tensor input_x, Tensor gamma, Tensor beta, float epsilon) -> Tensor",
    "pre_layer_norm_v2(Tensor z_res, Tensor z_hid, Tensor x_res, Tensor y_hid, Tensor gamma, Tensor beta, float epsilon) -> ()",
    "post_layer_norm_v2(Tensor output_z, Tensor input_x, Tensor input_y, Tensor gamma, Tensor beta, float epsilon) -> Tensor",
    "rms_norm_v2(Tensor output_z, Tensor input_x, Tensor gamma, float epsilon) -> Tensor",
    "rms_pre_norm_v2(Tensor z_res, Tensor z_hid, Tensor x_res, Tensor y_hid, Tensor gamma, float epsilon) -> ()",
    "gated_activation_v2(Tensor output, Tensor input, Tensor? bias, int act_func_type) -> ()",
    "wf6af16_linear(Tensor output, Tensor hidden_states, Tensor weights_2bit, Tensor weights_4bit, Tensor scales, Tensor? out_scales, int bsz, int seq_len) -> ()",
    "preprocess_weight(Tensor fp16_weight) -> (Tensor, Tensor)",
    "mixed_gemm(Tensor A, Tensor B, Tensor scale, int out_dtype) -> Tensor",
    "moe_gemm(Tensor hidden_states, Tensor expert_weights, Tensor topk_ids) -> Tensor",
    "mixed_moe_gemm(Tensor hidden_states, Tensor expert_weights, Tensor scales, Tensor topk_ids) -> Tensor",
    "build_atoms(Tensor atoms, Tensor batch_metadata, Tensor inflight_seq_descriptors, Tensor kv_ptrs, int q_block_size, int kv_block_size) -> int",
    "flash_attn_by_atoms(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor atoms, int n_atoms) -> ()",
    "kv_rotary_embeddings(Tensor kv_cache, Tensor qkv, Tensor batch_metadata, int rotary_dim, int num_heads, int head_dim) -> ()",
    "linear_kv_copy(Tensor kv_cache, Tensor qkv, Tensor batch_metadata, int num_heads, int head_dim) -> ()",
    "ragged_embed(Tensor output, Tensor input_ids, Tensor weight, Tensor batch_metadata) -> ()",
    "gather_for_logits(Tensor final_token_activations, Tensor all_activations, Tensor batch_metadata) -> ()",
    "ds_moe_gather(Tensor layer_output, Tensor moe_output, Tensor scores, Tensor assignments, Tensor dest_idx) -> ()",
    "ds_moe_scatter(Tensor moe_input, Tensor expert_cumsum, Tensor mapped_slots, Tensor hidden_states, Tensor batch_metadata) -> ()",
    "top_k_gating(Tensor expert_counts, Tensor scores, Tensor assignments, Tensor dest_idx, Tensor logits, Tensor batch_metadata, int num_experts) -> ()",
    "inference_all_reduce(Tensor input) -> Tensor",
)

# DeepCompile stubs: dc:: ops, all stubs.
DC_STUB_SCHEMAS = (
    "allgather_param(Tensor a, int graph_id, int id) -> Tensor",
    "prefetch_params_fused(int graph_id, Tensor[] params, int[] ids) -> ()",
    "wait_allgather(Tensor a, int graph_id, int id) -> Tensor",
    "release_param(Tensor a, int graph_id, int id, int n_users) -> Tensor",
    "reduce_grad(Tensor a, int graph_id, int id) -> Tensor",
    "free_tensors(Tensor[] a) -> ()",
    "offload_tensor(Tensor a, int id, int id2) -> Tensor",
    "reload_tensor(Tensor a, int id, int id2) -> Tensor",
    "wait_offload(Tensor a, int id, int id2) -> Tensor",
    "wait_reload(Tensor a, int id, int id2) -> Tensor",
    "offload_parameter(Tensor a, int id, int id2) -> ()",
    "reload_parameter(Tensor a, int id, int id2) -> ()",
    "end_backward(Tensor[] deps, int graph_id) -> ()",
)

# Stub classes: Python classes of torch_supa_ext.deepspeed_classes that raise on use.
STUB_CLASS_NAMES = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "AIOHandle", "GDSHandle")

EXPECTED_COUNTS = {"kernels": 23, "stubs": 66, "dc_stubs": 13, "classes": 5}


def op_name(schema: str) -> str:
    """The operator name a schema string defines (the text before its argument list)."""
    return schema[:schema.index("(")]


def _check_counts() -> None:
    # A wrong table would silently register a different op set than the real package;
    # fail at import instead.
    actual = {"kernels": len(KERNEL_SCHEMAS), "stubs": len(STUB_SCHEMAS),
              "dc_stubs": len(DC_STUB_SCHEMAS), "classes": len(STUB_CLASS_NAMES)}
    if actual != EXPECTED_COUNTS:
        raise ImportError(f"torch_supa_ext schema tables are inconsistent: {actual} != {EXPECTED_COUNTS}")
    names = [op_name(s) for s in KERNEL_SCHEMAS + STUB_SCHEMAS]
    if len(set(names)) != len(names):
        raise ImportError("torch_supa_ext schema tables define a deepspeed:: op twice")


_check_counts()
