"""Emulated torch_supa_ext: import switching, exact op schemas, stubs (the reference kernels:
test_torch_supa_ext_kernels.py).

The op tests need ``import torch_supa_ext`` to resolve to the emulated package, i.e. a process
started with SUPA_EMULATE=1 SUPA_EMU_EXT=1. Registering the ops in the main pytest process
would change what every other test sees (op builders probe ``torch.ops.deepspeed``), so by
default ``test_ext_suite_in_subprocess`` runs the op tests of this file and of
test_torch_supa_ext_kernels.py in a child pytest with SUPA_EMU_EXT=1; a run that already has
SUPA_EMU_EXT=1 runs them directly. The op tests carry
the ``ext_ops`` mark: a run without SUPA_EMU_EXT=1 does not collect them (conftest.py), so they
are not reported as skips; the child's own count is printed in the parent's summary.

Numerical references are written here in plain PyTorch (or are torch.optim), never the code
under test.
"""

import os
import pathlib
import sys

import pytest
import torch

import harness

EXT_ACTIVE = os.environ.get("SUPA_EMU_EXT") == "1"
DEVICE = "supa"

needs_ext = pytest.mark.ext_ops  # collected only with SUPA_EMU_EXT=1 (see conftest.py)
outer_only = pytest.mark.skipif(EXT_ACTIVE, reason="drives child processes; not rerun inside them")
KERNEL_TESTS = pathlib.Path(__file__).with_name("test_torch_supa_ext_kernels.py")  # op tests of the child run too


# The schemas of torch_supa_ext 2.12.0a1, one per line, as its wheel registers them.
KERNEL_OPS = """
layer_norm(Tensor input, Tensor gamma, Tensor beta, float epsilon) -> Tensor
_layer_norm_residual(Tensor input, Tensor bias, Tensor residual, Tensor gamma, Tensor beta, float epsilon) -> Tensor
layer_norm_residual_store_pre_ln_res(Tensor input, Tensor bias, Tensor residual, Tensor gamma, Tensor beta, float epsilon) -> (Tensor, Tensor)
multi_tensor_adam(int chunk_size, Tensor noop_flag, Tensor[] grads, Tensor[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, float lr, float beta1, float beta2, float epsilon, int step, int mode, int bias_correction, float weight_decay) -> ()
multi_tensor_lion(int chunk_size, Tensor noop_flag, Tensor[] grads, Tensor[] params, Tensor[] exp_avgs, float lr, float beta1, float beta2, int step, float weight_decay) -> ()
nhwc_bias_add(Tensor input, Tensor bias) -> Tensor
nhwc_bias_add_add(Tensor input, Tensor bias, Tensor other) -> Tensor
nhwc_bias_add_bias_add(Tensor input, Tensor bias, Tensor other, Tensor other_bias) -> Tensor
bias_gelu(Tensor activation, Tensor bias) -> Tensor
bias_add(Tensor activation, Tensor bias) -> Tensor
bias_relu(Tensor activation, Tensor bias) -> Tensor
bias_residual(Tensor output, Tensor bias, Tensor residual) -> Tensor
gated_activation(Tensor activation, Tensor bias, int activation_func_type) -> Tensor
_vector_add(Tensor a, Tensor b, float gamma) -> Tensor
moe_res_matmul(Tensor moe_res, Tensor coef, Tensor output) -> Tensor
residual_add_bias(Tensor hidden_state, Tensor(a!) residual, Tensor? attention_output, Tensor? attention_bias, Tensor? final_bias, int mp_size, bool mlp_after_attn, bool add_bias, bool pre_layer_norm) -> ()
ds_quantize(Tensor(a!) vals, int groups, int bits) -> Tensor(a!)
ds_quantize_asym(Tensor(a!) vals, int groups, int bits) -> Tensor(a!)
quantize(Tensor input_vals, int groups, int numBits, int quantType) -> Tensor[]
dequantize(Tensor quantized_data, Tensor params, int groups, int num_bits, int quant_type) -> Tensor
dequantize_fp32(Tensor quantized_data, Tensor params, int groups, int num_bits, int quant_type) -> Tensor
dequantize_int4_to_half_experimental(Tensor data_in, Tensor scale_buffer, Tensor min_val_buffer, int num_group, int group_size) -> Tensor
dequantize_int8_to_half_experimental(Tensor data_in, Tensor scale_buffer, Tensor min_val_buffer, int num_group, int group_size) -> Tensor
""".strip().splitlines()

STUB_OPS = """
lamb(Tensor p, Tensor p_copy, Tensor m, Tensor v, Tensor g, float lr, float beta1, float beta2, float max_coeff, float min_coeff, float eps, float grad_scale, int step, int mode, int bias_correction, float decay) -> Tensor
transformer_forward_fp32(int layer_id, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b, bool training_mode, bool prelayernorm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint) -> Tensor[]
transformer_forward_fp16(int layer_id, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b, bool training_mode, bool prelayernorm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint) -> Tensor[]
transformer_backward_fp32(int layer_id, Tensor grad_output, Tensor output, Tensor inp_norm, Tensor qkv_tf, Tensor soft_out, Tensor ctx_bufB, Tensor attn_o_inp, Tensor add_res, Tensor ff1_inp, Tensor gelu_inp, Tensor ff2_inp, Tensor attn_prob_dropout_mask, Tensor attn_output_dropout_mask, Tensor layer_output_dropout_mask, Tensor attn_layer_norm_var, Tensor attn_layer_norm_mean, Tensor layer_norm_var, Tensor layer_norm_mean, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b) -> Tensor[]
transformer_backward_fp16(int layer_id, Tensor grad_output, Tensor output, Tensor inp_norm, Tensor qkv_tf, Tensor soft_out, Tensor ctx_bufB, Tensor attn_o_inp, Tensor add_res, Tensor ff1_inp, Tensor gelu_inp, Tensor ff2_inp, Tensor attn_prob_dropout_mask, Tensor attn_output_dropout_mask, Tensor layer_output_dropout_mask, Tensor attn_layer_norm_var, Tensor attn_layer_norm_mean, Tensor layer_norm_var, Tensor layer_norm_mean, Tensor input, Tensor input_mask, Tensor attn_qkvw, Tensor attn_qkvb, Tensor attn_ow, Tensor attn_ob, Tensor attn_nw, Tensor attn_nb, Tensor inter_w, Tensor inter_b, Tensor output_w, Tensor output_b, Tensor norm_w, Tensor norm_b) -> Tensor[]
create_transformer_layer_fp32(int layer_id, int batch_size, int hidden_dim, int num_heads, int intermediate_size, float attn_dropout_ratio, float hidden_dropout_ratio, float layer_norm_eps, int seed, bool pre_or_postLayerNorm, bool test_gemm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint, bool stochastic_mode) -> int
create_transformer_layer_fp16(int layer_id, int batch_size, int hidden_dim, int num_heads, int intermediate_size, float attn_dropout_ratio, float hidden_dropout_ratio, float layer_norm_eps, int seed, bool pre_or_postLayerNorm, bool test_gemm, bool attn_dropout_checkpoint, bool normalize_invertible, bool gelu_checkpoint, bool stochastic_mode) -> int
softmax(Tensor attn_scores, Tensor attn_mask, Tensor? alibi, bool triangular, bool recompute, bool local_attention, int window_size, bool async_op, float layer_scale, int head_offset, int mp_size) -> Tensor
softmax_context(Tensor query_key_value, Tensor prev_key, Tensor new_key, Tensor attn_mask, Tensor prev_value, Tensor new_value, int heads, float norm_factor, bool merging, bool triangular, bool local_attention, int window_size, bool no_masking) -> (Tensor, Tensor, Tensor)
softmax_context_int8(Tensor query_key_value, Tensor prev_key, Tensor new_key, Tensor attn_mask, Tensor prev_value, Tensor new_value, int heads, float norm_factor, bool merging, bool triangular, bool local_attention, int window_size, bool no_masking) -> (Tensor, Tensor, Tensor)
qkv_gemm(Tensor input, Tensor weight, Tensor? q_scale, Tensor bias, Tensor gamma, Tensor beta, float eps, bool add_bias, bool q_int8, bool transpose) -> (Tensor, Tensor)
rms_qkv_gemm(Tensor input, Tensor weight, Tensor? q_scale, Tensor gamma, float eps, bool q_int8, bool transpose) -> (Tensor, Tensor)
mlp_gemm(Tensor input, Tensor residual, Tensor input_bias, Tensor weight_interm, Tensor weight_out, Tensor bias, Tensor gamma, Tensor beta, float eps, bool pre_layer_norm, bool mlp_after_attn, Tensor? q_scale, Tensor? q_scale1, bool q_int8, int activation_type, bool transpose) -> (Tensor, Tensor)
rms_mlp_gemm(Tensor input, Tensor residual, Tensor weight_interm, Tensor weight_out, Tensor gamma, float eps, Tensor? interm_scale, Tensor? out_scale, int dtype, int mlp_act_func_type, bool transpose) -> (Tensor, Tensor)
vector_matmul(Tensor input, Tensor weight, bool async_op, Tensor? q_scale, bool q_int8, bool transpose) -> Tensor
linear_layer(Tensor input, Tensor weight, Tensor bias, bool add_bias, bool do_flash_attn, int num_heads, bool transpose, float rope_theta) -> Tensor
fused_gemm_gelu(Tensor input, Tensor weight, Tensor? scale, Tensor bias, Tensor? out, Tensor? out_scale, int dtype, bool transpose) -> Tensor
rms_norm(Tensor input, Tensor gamma, float epsilon) -> Tensor
pre_rms_norm(Tensor input, Tensor residual, Tensor gamma, float epsilon) -> (Tensor, Tensor)
apply_rotary_pos_emb(Tensor mixed_query, Tensor key_layer, int rotary_dim, int offset, int num_heads, bool rotate_half, float rope_theta) -> Tensor[]
pad_transform(Tensor query, Tensor key, Tensor value, int heads, bool do_flash_attn) -> Tensor
einsum_sec_sm_ecm(Tensor Q, Tensor W) -> Tensor
allocate_workspace(int hidden_dim, int num_heads, int prompt_length, int batch_size, int num_layers, int mp_size, bool external_cache, int rank, int max_out_tokens, int min_out_tokens) -> ()
release_workspace() -> ()
retake_workspace() -> bool
reset_cache() -> ()
ds_sr_quantize(Tensor vals, int groups, int bits) -> Tensor
ds_sr_quantize_asym(Tensor vals, int groups, int bits) -> Tensor
swizzle_quant(Tensor input_vals, int groups, int num_bits, int quant_type, int pipeline_size, int nodes, int devices_per_node) -> Tensor[]
quantized_reduction(Tensor input_vals, Tensor input_scales, int in_groups, int out_groups, int num_bits, int quant_type, int devices_per_node) -> Tensor[]
loco_swizzle_quant(Tensor input_vals, Tensor error_feedback, float err_beta, int groups, int num_bits, int quant_type, int pipeline_size, int nodes, int devices_per_node) -> Tensor[]
loco_quantized_reduction(Tensor input_vals, Tensor input_scales, Tensor error_feedback, float err_beta, int in_groups, int out_groups, int num_bits, int quant_type, int devices_per_node) -> Tensor[]
fp_quantize(Tensor out, Tensor val, int group_size, int stochastic_rounding, int q_bits, int q_mantisa_bits) -> Tensor
fp_dequantize(Tensor val, Tensor val_q, int group_size, int mantisa_bits, int exp_bits) -> ()
fp_selective_dequantize(Tensor val, Tensor val_q, Tensor indexes, int group_size, int mantisa_bits, int exp_bits) -> ()
attention(Tensor q, Tensor k, Tensor v, Tensor? bias1, Tensor? bias2, Tensor o, Tensor lse) -> ()
attention_bwd(Tensor go, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor delta, Tensor? bias1, Tensor? bias2, Tensor gq, Tensor gk, Tensor gv, Tensor? gb1, Tensor? gb2) -> ()
token_sort_(Tensor unsorted_token_ids, int original_tokens) -> Tensor
token_gather(Tensor activations, Tensor sorted_indices, bool batch_first) -> Tensor
token_scatter_(Tensor all_activations, Tensor layer_activations, Tensor sorted_indices, bool batch_first) -> Tensor
mask_gather_bert(Tensor dense_mask, Tensor sorted_indices, int reserved_length) -> Tensor
mask_gather_gpt(Tensor dense_mask, int truncated_seq_len) -> Tensor
bias_activation_v2(Tensor activation, Tensor? bias, int act_func_type) -> Tensor
blas_linear_v2(Tensor output, Tensor hidden_states, Tensor weights) -> Tensor
blas_4d_matmul(Tensor output, Tensor A, Tensor B, bool is_bcast_b) -> Tensor
layer_norm_v2(Tensor output_z, Tensor input_x, Tensor gamma, Tensor beta, float epsilon) -> Tensor
pre_layer_norm_v2(Tensor z_res, Tensor z_hid, Tensor x_res, Tensor y_hid, Tensor gamma, Tensor beta, float epsilon) -> ()
post_layer_norm_v2(Tensor output_z, Tensor input_x, Tensor input_y, Tensor gamma, Tensor beta, float epsilon) -> Tensor
rms_norm_v2(Tensor output_z, Tensor input_x, Tensor gamma, float epsilon) -> Tensor
rms_pre_norm_v2(Tensor z_res, Tensor z_hid, Tensor x_res, Tensor y_hid, Tensor gamma, float epsilon) -> ()
gated_activation_v2(Tensor output, Tensor input, Tensor? bias, int act_func_type) -> ()
wf6af16_linear(Tensor output, Tensor hidden_states, Tensor weights_2bit, Tensor weights_4bit, Tensor scales, Tensor? out_scales, int bsz, int seq_len) -> ()
preprocess_weight(Tensor fp16_weight) -> (Tensor, Tensor)
mixed_gemm(Tensor A, Tensor B, Tensor scale, int out_dtype) -> Tensor
moe_gemm(Tensor hidden_states, Tensor expert_weights, Tensor topk_ids) -> Tensor
mixed_moe_gemm(Tensor hidden_states, Tensor expert_weights, Tensor scales, Tensor topk_ids) -> Tensor
build_atoms(Tensor atoms, Tensor batch_metadata, Tensor inflight_seq_descriptors, Tensor kv_ptrs, int q_block_size, int kv_block_size) -> int
flash_attn_by_atoms(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor atoms, int n_atoms) -> ()
kv_rotary_embeddings(Tensor kv_cache, Tensor qkv, Tensor batch_metadata, int rotary_dim, int num_heads, int head_dim) -> ()
linear_kv_copy(Tensor kv_cache, Tensor qkv, Tensor batch_metadata, int num_heads, int head_dim) -> ()
ragged_embed(Tensor output, Tensor input_ids, Tensor weight, Tensor batch_metadata) -> ()
gather_for_logits(Tensor final_token_activations, Tensor all_activations, Tensor batch_metadata) -> ()
ds_moe_gather(Tensor layer_output, Tensor moe_output, Tensor scores, Tensor assignments, Tensor dest_idx) -> ()
ds_moe_scatter(Tensor moe_input, Tensor expert_cumsum, Tensor mapped_slots, Tensor hidden_states, Tensor batch_metadata) -> ()
top_k_gating(Tensor expert_counts, Tensor scores, Tensor assignments, Tensor dest_idx, Tensor logits, Tensor batch_metadata, int num_experts) -> ()
inference_all_reduce(Tensor input) -> Tensor
""".strip().splitlines()

DC_STUB_OPS = """
allgather_param(Tensor a, int graph_id, int id) -> Tensor
prefetch_params_fused(int graph_id, Tensor[] params, int[] ids) -> ()
wait_allgather(Tensor a, int graph_id, int id) -> Tensor
release_param(Tensor a, int graph_id, int id, int n_users) -> Tensor
reduce_grad(Tensor a, int graph_id, int id) -> Tensor
free_tensors(Tensor[] a) -> ()
offload_tensor(Tensor a, int id, int id2) -> Tensor
reload_tensor(Tensor a, int id, int id2) -> Tensor
wait_offload(Tensor a, int id, int id2) -> Tensor
wait_reload(Tensor a, int id, int id2) -> Tensor
offload_parameter(Tensor a, int id, int id2) -> ()
reload_parameter(Tensor a, int id, int id2) -> ()
end_backward(Tensor[] deps, int graph_id) -> ()
""".strip().splitlines()

STUB_CLASSES = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "AIOHandle", "GDSHandle")


def _name(schema):
    return schema[:schema.index("(")]


def _child_env(ext: bool) -> dict:
    """A child on the emulated card, with or without the emulated torch_supa_ext."""
    return {"SUPA_EMULATE": "1", "DS_ACCELERATOR": "supa", "SUPA_EMU_EXT": "1" if ext else None}


def _run_child(command, ext, timeout=600):
    """Runs `command` with the checkout first on the path (see _child_env)."""
    return harness.fresh_process(command, env=_child_env(ext), timeout=timeout, checkout_first=True, check=False)


def _in_child(fn, ext, timeout=600):
    """What `fn`, a function of this file, returns in a child (see _run_child)."""
    return harness.fresh_process(fn, env=_child_env(ext), timeout=timeout, checkout_first=True).value


# ---------------------------------------------------------------- switching (main process)

def test_reference_tables_have_the_published_sizes():
    assert (len(KERNEL_OPS), len(STUB_OPS), len(DC_STUB_OPS)) == (23, 66, 13)
    assert len(KERNEL_OPS) + len(STUB_OPS) == 89


def _what_there_is_of_the_ext() -> dict:
    import importlib.util

    try:
        import torch_supa_ext  # noqa: F401
        imported = True
    except ModuleNotFoundError:
        imported = False
    return {"imported": imported, "spec": importlib.util.find_spec("torch_supa_ext") is not None,
            "adam_op": hasattr(torch.ops.deepspeed, "multi_tensor_adam"), "dc_op": hasattr(torch.ops.dc, "end_backward")}


@outer_only
def test_absent_without_supa_emu_ext():
    assert _in_child(_what_there_is_of_the_ext, ext=False) == {
        "imported": False, "spec": False, "adam_op": False, "dc_op": False}


@pytest.mark.slow  # a whole pytest run in a fresh interpreter
@outer_only
def test_ext_suite_in_subprocess(report_child_run):
    outer = ["test_absent_without_supa_emu_ext", "test_ext_suite_in_subprocess",
             "test_fused_adam_emulated_kernel_matches_fallback"]
    proc = _run_child([sys.executable, "-m", "pytest", __file__, KERNEL_TESTS, "-q", "-n", "0", "-p", "no:cacheprovider",
                       "-k", " and ".join(f"not {name}" for name in outer)], ext=True, timeout=1200)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"op tests failed with SUPA_EMU_EXT=1:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    assert "skipped" not in summary, summary
    assert "passed" in summary, summary
    report_child_run(f"emulated torch_supa_ext op tests (child run with SUPA_EMU_EXT=1): {summary}")


def _fused_adam_steps() -> dict:
    """In a child: 30 FusedAdam steps in each mode; the parameters, and whether the kernel ran."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from deepspeed.ops.adam import FusedAdam

    class OpNames(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    shapes = [(64, 33), (7,), (3, 5, 11), (1000,)]
    results, seen = {}, set()
    for adam_w_mode, dtype in ((True, torch.float32), (False, torch.float32), (True, torch.bfloat16)):
        gen = torch.Generator().manual_seed(1234)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).to("supa", dtype)) for s in shapes]
        opt = FusedAdam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, adam_w_mode=adam_w_mode)
        recorder = OpNames()
        for _ in range(30):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to("supa", dtype)
            with recorder:
                opt.step()
        seen |= recorder.names
        results[f"{adam_w_mode}-{dtype}"] = [p.detach().float().cpu().tolist() for p in params]
    return {"kernel_used": "deepspeed.multi_tensor_adam.default" in seen, "results": results}


@outer_only
@pytest.mark.slow  # two DeepSpeed processes, 90 optimizer steps each
def test_fused_adam_emulated_kernel_matches_fallback():
    with_kernel = _in_child(_fused_adam_steps, ext=True)
    fallback = _in_child(_fused_adam_steps, ext=False)
    assert with_kernel["kernel_used"], "FusedAdam did not call torch.ops.deepspeed.multi_tensor_adam"
    assert not fallback["kernel_used"]
    for case, params in with_kernel["results"].items():
        # fp32: same math up to operation order. bf16: both round the fp32 result into bf16 each
        # step, so an occasional one-ulp difference may compound a little.
        tol = dict(rtol=1e-5, atol=1e-6) if case.endswith("float32") else dict(rtol=2e-2, atol=2e-2)
        for got, want in zip(params, fallback["results"][case]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol, msg=case)


# ---------------------------------------------------------------- import surface

@pytest.fixture(scope="module")
def ext():
    import torch_supa_ext
    return torch_supa_ext


@needs_ext
def test_import_surface(ext):
    assert ext.__version__ == "2.12.0a1"
    assert ext.EMULATED is True
    import torch_supa_ext.deepspeed  # noqa: F401  (the compiled module of the real package)
    import torch_supa_ext.deepspeed_classes as classes
    assert all(hasattr(classes, name) for name in STUB_CLASSES)


@needs_ext
def test_import_is_idempotent(ext):
    import importlib
    before = str(torch.ops.deepspeed.multi_tensor_adam.default._schema)
    import supa_emu.torch_supa_ext  # the same package under its own name
    importlib.reload(importlib.import_module("torch_supa_ext.deepspeed"))
    importlib.reload(importlib.import_module("torch_supa_ext.stub_ops"))
    assert str(torch.ops.deepspeed.multi_tensor_adam.default._schema) == before
    x = torch.randn(2, 3, 8, device=DEVICE)
    torch.testing.assert_close(torch.ops.deepspeed.bias_add(x, torch.ones(8, device=DEVICE)).cpu(), x.cpu() + 1)


# ---------------------------------------------------------------- schemas and stubs

@needs_ext
@pytest.mark.parametrize("namespace,schema",
                         [("deepspeed", s) for s in KERNEL_OPS + STUB_OPS] + [("dc", s) for s in DC_STUB_OPS],
                         ids=lambda v: _name(v) if "(" in v else v)
def test_schema_is_the_real_one(ext, namespace, schema):
    op = getattr(getattr(torch.ops, namespace), _name(schema))
    assert str(op.default._schema) == f"{namespace}::{schema}"


def _placeholder_args(schema, device):
    tensor = torch.zeros(4, device=device)
    values = {"Tensor": tensor, "Optional[Tensor]": None, "List[Tensor]": [tensor], "int": 1,
              "float": 1.0, "bool": False, "List[int]": [1]}
    return [values[str(arg.type)] for arg in schema.arguments]


@needs_ext
@pytest.mark.parametrize("namespace,name",
                         [("deepspeed", _name(s)) for s in STUB_OPS] + [("dc", _name(s)) for s in DC_STUB_OPS])
def test_stub_raises_the_real_text_and_traces(ext, namespace, name):
    op = getattr(getattr(torch.ops, namespace), name).default
    with pytest.raises(NotImplementedError) as excinfo:
        op(*_placeholder_args(op._schema, DEVICE))
    assert str(excinfo.value) == f"{namespace}::{name} not yet implemented on SUPA"
    if not any("Tensor" in str(arg.type) for arg in op._schema.arguments):
        return  # no tensor to carry a device: tracing calls the kernel, as with the real package
    # The fake implementation returns the schema's structure without raising.
    out = op(*_placeholder_args(op._schema, "meta"))
    returns = [str(r.type) for r in op._schema.returns]
    if not returns:
        assert out is None
    elif len(returns) > 1:
        assert isinstance(out, tuple) and len(out) == len(returns)


@needs_ext
@pytest.mark.parametrize("name", STUB_CLASSES)
def test_stub_classes_raise(ext, name):
    cls = getattr(__import__("torch_supa_ext.deepspeed_classes", fromlist=[name]), name)
    message = f"{name} not yet implemented on SUPA"
    with pytest.raises(NotImplementedError, match=f"^{message}$"):
        cls()
    with pytest.raises(NotImplementedError, match=f"^{message}$"):
        cls.step(object.__new__(cls))


@needs_ext
def test_ops_with_kernels_have_device_kernels_only(ext):
    for schema in KERNEL_OPS:
        qualname = f"deepspeed::{_name(schema)}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "PrivateUse1"), qualname
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU"), qualname
