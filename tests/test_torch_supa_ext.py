"""Emulated torch_supa_ext: import switching, exact op schemas, reference kernels, stubs.

The op tests need ``import torch_supa_ext`` to resolve to the emulated package, i.e. a process
started with SUPA_EMULATE=1 SUPA_EMU_EXT=1. Registering the ops in the main pytest process
would change what every other test sees (op builders probe ``torch.ops.deepspeed``), so by
default ``test_ext_suite_in_subprocess`` runs this file's op tests in a child pytest with
SUPA_EMU_EXT=1; a run that already has SUPA_EMU_EXT=1 runs them directly. The op tests carry
the ``ext_ops`` mark: a run without SUPA_EMU_EXT=1 does not collect them (conftest.py), so they
are not reported as skips; the child's own count is printed in the parent's summary.

Numerical references are written here in plain PyTorch (or are torch.optim), never the code
under test.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

import harness

EXT_ACTIVE = os.environ.get("SUPA_EMU_EXT") == "1"
DEVICE = "supa"

needs_ext = pytest.mark.ext_ops  # collected only with SUPA_EMU_EXT=1 (see conftest.py)
outer_only = pytest.mark.skipif(EXT_ACTIVE, reason="drives child processes; not rerun inside them")


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
    return harness.run(command, env=_child_env(ext), timeout=timeout, checkout_first=True)


def _in_child(fn, ext, timeout=600):
    """What `fn`, a function of this file, returns in a child (see _run_child)."""
    return harness.run_function(fn, env=_child_env(ext), timeout=timeout, checkout_first=True).value


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
    proc = _run_child([sys.executable, "-m", "pytest", __file__, "-q", "-n", "0", "-p", "no:cacheprovider",
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


# ---------------------------------------------------------------- reference kernels

def _dev(t):
    """A device copy of ``t`` (never ``t`` itself, so in-place kernels leave the reference alone)."""
    return t.to(DEVICE, copy=True)


def _assert_meta_agrees(op, args, out):
    """The fake implementation predicts the kernel's output shapes and dtypes."""
    meta_args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    fake = op(*meta_args)
    outs, fakes = (out, fake) if isinstance(out, (list, tuple)) else ((out,), (fake,))
    assert len(outs) == len(fakes)
    for o, f in zip(outs, fakes):
        assert (o.shape, o.dtype) == (f.shape, f.dtype)


def _tol(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]


FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm(ext, dtype):
    x, gamma, beta = torch.randn(2, 5, 64), torch.randn(64), torch.randn(64)
    args = [_dev(x.to(dtype)), _dev(gamma.to(dtype)), _dev(beta.to(dtype)), 1e-5]
    out = torch.ops.deepspeed.layer_norm(*args)
    want = F.layer_norm(x.to(dtype).float(), (64,), gamma.to(dtype).float(), beta.to(dtype).float(), 1e-5)
    assert out.device.type == DEVICE and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed.layer_norm, args, out)


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_residual_variants(ext, dtype):
    x, bias, res = (torch.randn(3, 4, 32).to(dtype), torch.randn(32).to(dtype), torch.randn(3, 4, 32).to(dtype))
    gamma, beta = torch.randn(32).to(dtype), torch.randn(32).to(dtype)
    pre_ln = (x.float() + bias.float() + res.float()).to(dtype)
    want = F.layer_norm(pre_ln.float(), (32,), gamma.float(), beta.float(), 1e-6)
    args = [_dev(x), _dev(bias), _dev(res), _dev(gamma), _dev(beta), 1e-6]

    out = torch.ops.deepspeed._layer_norm_residual(*args)
    torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed._layer_norm_residual, args, out)

    norm, stored = torch.ops.deepspeed.layer_norm_residual_store_pre_ln_res(*args)
    torch.testing.assert_close(norm.cpu().float(), want, **_tol(dtype))
    torch.testing.assert_close(stored.cpu(), pre_ln, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed.layer_norm_residual_store_pre_ln_res, args, (norm, stored))


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name,act", [("bias_add", lambda v: v), ("bias_relu", lambda v: v.clamp(min=0)),
                                      ("bias_gelu", _gelu_tanh)])
def test_bias_activations(ext, dtype, name, act):
    x, b = torch.randn(2, 3, 48).to(dtype), torch.randn(48).to(dtype)
    args = [_dev(x), _dev(b)]
    before = x.clone()
    out = getattr(torch.ops.deepspeed, name)(*args)
    torch.testing.assert_close(out.cpu().float(), act(x.float() + b.float()), **_tol(dtype))
    torch.testing.assert_close(args[0].cpu(), before)  # inputs are not modified
    _assert_meta_agrees(getattr(torch.ops.deepspeed, name), args, out)


@needs_ext
def test_bias_residual(ext):
    x, b, r = torch.randn(2, 3, 16), torch.randn(16), torch.randn(2, 3, 16)
    out = torch.ops.deepspeed.bias_residual(_dev(x), _dev(b), _dev(r))
    torch.testing.assert_close(out.cpu(), x + r + b)
    # DeepSpeed's MoE layer passes a one-element placeholder meaning "no bias".
    out = torch.ops.deepspeed.bias_residual(_dev(x), torch.empty(1), _dev(r))
    torch.testing.assert_close(out.cpu(), x + r)


@needs_ext
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("func_type,gate_fn", [(3, lambda g: 0.5 * g * (1 + torch.erf(g / 2 ** 0.5))),
                                               (4, lambda g: g * torch.sigmoid(g))])
def test_gated_activation(ext, dtype, func_type, gate_fn):
    x, b = torch.randn(2, 5, 40).to(dtype), torch.randn(40).to(dtype)
    args = [_dev(x), _dev(b), func_type]
    out = torch.ops.deepspeed.gated_activation(*args)
    xb = x.float() + b.float()
    want = xb[..., :20] * gate_fn(xb[..., 20:])
    assert out.shape == (2, 5, 20)
    torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
    _assert_meta_agrees(torch.ops.deepspeed.gated_activation, args, out)
    with pytest.raises(Exception, match="activation_func_type"):
        torch.ops.deepspeed.gated_activation(_dev(x), _dev(b), 1)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nhwc_bias_adds(ext, dtype):
    x = torch.randn(2, 8, 5, 3).to(dtype).to(memory_format=torch.channels_last)
    other = torch.randn(2, 8, 5, 3).to(dtype).to(memory_format=torch.channels_last)
    bias, other_bias = torch.randn(8).to(dtype), torch.randn(8).to(dtype)
    per_channel = lambda t: t.float().view(1, 8, 1, 1)  # noqa: E731
    cases = {
        "nhwc_bias_add": ([x, bias], x.float() + per_channel(bias)),
        "nhwc_bias_add_add": ([x, bias, other], x.float() + per_channel(bias) + other.float()),
        "nhwc_bias_add_bias_add": ([x, bias, other, other_bias],
                                   x.float() + per_channel(bias) + other.float() + per_channel(other_bias)),
    }
    for name, (inputs, want) in cases.items():
        args = [_dev(t) for t in inputs]
        out = getattr(torch.ops.deepspeed, name)(*args)
        assert out.is_contiguous(memory_format=torch.channels_last), name
        torch.testing.assert_close(out.cpu().float(), want, **_tol(dtype))
        _assert_meta_agrees(getattr(torch.ops.deepspeed, name), args, out)
    seq = torch.randn(2, 7, 8).to(dtype)  # [B, S, C] layout
    out = torch.ops.deepspeed.nhwc_bias_add(_dev(seq), _dev(bias))
    torch.testing.assert_close(out.cpu().float(), seq.float() + bias.float(), **_tol(dtype))


@needs_ext
def test_vector_add(ext):
    a, b = torch.randn(3, 17), torch.randn(3, 17)
    args = [_dev(a), _dev(b), 0.25]
    out = torch.ops.deepspeed._vector_add(*args)
    torch.testing.assert_close(out.cpu(), 0.25 * a + b)
    _assert_meta_agrees(torch.ops.deepspeed._vector_add, args, out)


@needs_ext
def test_moe_res_matmul_updates_output(ext):
    moe_res, output, coef = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(2, 16)
    dev_out = _dev(output)
    returned = torch.ops.deepspeed.moe_res_matmul(_dev(moe_res), _dev(coef), dev_out)
    want = output * coef[1] + moe_res * coef[0]
    torch.testing.assert_close(returned.cpu(), want)
    torch.testing.assert_close(dev_out.cpu(), want)  # DeepSpeed reads the result from `output`


@needs_ext
@pytest.mark.parametrize("mlp_after_attn,pre_layer_norm,add_bias",
                         [(True, True, True), (True, False, True), (False, False, True), (False, False, False)])
def test_residual_add_bias(ext, mlp_after_attn, pre_layer_norm, add_bias):
    hidden, residual, attn = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    attn_bias, final_bias, mp = torch.randn(8), torch.randn(8), 2
    if mlp_after_attn and pre_layer_norm:
        want = (residual + attn + attn_bias + final_bias) / mp + hidden
    elif mlp_after_attn:
        want = residual + hidden + final_bias
    else:
        want = hidden + attn + (residual + final_bias + (attn_bias if add_bias else 0)) / mp
    dev_residual = _dev(residual)
    out = torch.ops.deepspeed.residual_add_bias(_dev(hidden), dev_residual, _dev(attn), _dev(attn_bias),
                                                _dev(final_bias), mp, mlp_after_attn, add_bias, pre_layer_norm)
    assert out is None
    torch.testing.assert_close(dev_residual.cpu(), want)


# ------------------------------------------------ quantization (plain-math references)

def _int4_codes(packed):
    """Signed 4-bit codes, earlier element in the high nibble."""
    b = packed.to(torch.int32) & 0xFF
    high, low = b >> 4, b & 0xF
    high, low = torch.where(high >= 8, high - 16, high), torch.where(low >= 8, low - 16, low)
    return torch.stack([high, low], -1).reshape(*packed.shape[:-1], -1)


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("quant_type", [0, 1])
def test_quantize_dequantize_round_trip(ext, bits, quant_type):
    groups = 6
    x = torch.randn(4, 3, 64).half()
    args = [_dev(x), groups, bits, quant_type]
    q, params = torch.ops.deepspeed.quantize(*args)
    _assert_meta_agrees(torch.ops.deepspeed.quantize, args, [q, params])
    assert q.dtype == torch.int8 and params.dtype == torch.float32
    assert params.shape == (groups, 2 if quant_type else 1)

    codes = (q.cpu().to(torch.int32) if bits == 8 else _int4_codes(q.cpu())).reshape(groups, -1).float()
    xg = x.float().reshape(groups, -1)
    params = params.cpu()
    if quant_type == 0:
        step = 2 * xg.abs().amax(1, keepdim=True) / 2 ** bits
        offset = torch.zeros_like(step)
    else:
        hi, lo = xg.amax(1, keepdim=True), xg.amin(1, keepdim=True)
        step, offset = (hi - lo) / 2 ** bits, (hi + lo) / 2
        torch.testing.assert_close(params[:, 1:], offset)
    torch.testing.assert_close(params[:, :1], step)
    assert codes.min() >= -(2 ** (bits - 1)) and codes.max() <= 2 ** (bits - 1) - 1
    # Every code is the nearest level, except at the clamped top of the range.
    err = (codes * step + offset - xg).abs()
    top = codes == 2 ** (bits - 1) - 1
    assert bool((err[~top] <= step.expand_as(err)[~top] * 0.5001).all())
    assert bool((err[top] <= step.expand_as(err)[top] * 1.0001).all())

    for name, dtype in [("dequantize", torch.float16), ("dequantize_fp32", torch.float32)]:
        dq_args = [q, _dev(params), groups, bits, quant_type]
        out = getattr(torch.ops.deepspeed, name)(*dq_args)
        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out.cpu().float(), (codes * step + offset).reshape(x.shape),
                                   rtol=1e-3, atol=1e-3)
        _assert_meta_agrees(getattr(torch.ops.deepspeed, name), dq_args, out)


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
def test_ds_quantize_symmetric_in_place(ext, bits):
    x = torch.randn(4, 256)
    vals = _dev(x)
    returned = torch.ops.deepspeed.ds_quantize(vals, 4, bits)
    assert returned.data_ptr() == vals.data_ptr()
    step = (2 * x.abs().amax(1, keepdim=True) + 1e-5) / 2 ** bits
    levels = vals.cpu() / step
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)  # values sit on the grid
    assert levels.min() >= -(2 ** (bits - 1)) - 1e-3 and levels.max() <= 2 ** (bits - 1) - 1 + 1e-3
    inside = x.abs() < step * (2 ** (bits - 1) - 1)
    assert bool(((vals.cpu() - x).abs()[inside] <= (step / 2 + 1e-6).expand_as(x)[inside]).all())


@needs_ext
@pytest.mark.parametrize("bits", [8, 4])
def test_ds_quantize_asymmetric_in_place(ext, bits):
    x = torch.rand(2, 128) * 3 + 1
    vals = _dev(x)
    assert torch.ops.deepspeed.ds_quantize_asym(vals, 2, bits).data_ptr() == vals.data_ptr()
    lo = x.amin(1, keepdim=True)
    step = (x.amax(1, keepdim=True) - lo + 1e-5) / 2 ** bits
    levels = (vals.cpu() - lo) / step
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-3)
    assert bool(((vals.cpu() - x).abs() <= step / 2 + 1e-6).all())


@needs_ext
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_experimental(ext, bits):
    num_group, group_size = 4, 32
    codes = torch.randint(0, 2 ** bits, (num_group, group_size))
    if bits == 4:
        data = (codes[:, 0::2] * 16 + codes[:, 1::2]).to(torch.uint8)
    else:
        data = codes.to(torch.uint8)
    scale, minimum = (torch.rand(num_group) + 0.5).half(), torch.randn(num_group).half()
    args = [_dev(data), _dev(scale), _dev(minimum), num_group, group_size]
    op = getattr(torch.ops.deepspeed, f"dequantize_int{bits}_to_half_experimental")
    out = op(*args)
    want = codes.float() / scale.float()[:, None] + minimum.float()[:, None]
    assert out.dtype == torch.float16 and out.shape == (num_group, group_size)
    torch.testing.assert_close(out.cpu().float(), want, rtol=2e-3, atol=2e-3)
    _assert_meta_agrees(op, args, out)


# ------------------------------------------------ fused optimizers

CHUNK = 2048 * 32
SHAPES = [(33, 17), (5,), (2, 3, 7), (301,)]


def _noop(value=0):
    return torch.tensor([value], dtype=torch.int32, device=DEVICE)


def _grad_stream(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]


@needs_ext
@pytest.mark.parametrize("mode,weight_decay", [(0, 0.0), (0, 0.05), (1, 0.0), (1, 0.1)])
def test_multi_tensor_adam_matches_torch_optim(ext, mode, weight_decay):
    lr, betas, eps, steps = 1e-2, (0.9, 0.999), 1e-8, 60
    init = [torch.randn(s) for s in SHAPES]
    ref_params = [p.clone().requires_grad_() for p in init]
    ref_cls = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    ref = ref_cls(ref_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    params = [_dev(p) for p in init]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_grad_stream(steps), start=1):
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
        torch.ops.deepspeed.multi_tensor_adam(CHUNK, _noop(), [_dev(g) for g in grads], params, exp_avgs,
                                              exp_avg_sqs, lr, betas[0], betas[1], eps, step, mode, 1,
                                              weight_decay)
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-6)


@needs_ext
def test_multi_tensor_adam_without_bias_correction(ext):
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.99, 1e-6, 0.01
    p = torch.randn(SHAPES[0])
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    params, ms, vs = [_dev(p)], [_dev(m)], [_dev(v)]
    for step, (g, *_) in enumerate(_grad_stream(20), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (v.sqrt() + eps) + wd * p)
        torch.ops.deepspeed.multi_tensor_adam(CHUNK, _noop(), [_dev(g)], params, ms, vs,
                                              lr, b1, b2, eps, step, 1, 0, wd)
    torch.testing.assert_close(params[0].cpu(), p, rtol=1e-5, atol=1e-6)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_multi_tensor_adam_low_precision(ext, dtype):
    # Reference: DeepSpeed's storage rule, fp32 math with params and states stored in `dtype`.
    lr, b1, b2, eps, wd, steps = 1e-2, 0.9, 0.999, 1e-8, 0.01, 50
    init = [torch.randn(s).to(dtype) for s in SHAPES]
    ref = [[p.clone(), torch.zeros_like(p), torch.zeros_like(p)] for p in init]
    params = [_dev(p) for p in init]
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_grad_stream(steps, seed=3), start=1):
        grads = [g.to(dtype) for g in grads]
        for state, g in zip(ref, grads):
            p, m, v = (t.float() for t in state)
            m = b1 * m + (1 - b1) * g.float()
            v = b2 * v + (1 - b2) * g.float() ** 2
            p = p - lr * ((m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps) + wd * p)
            state[:] = [p.to(dtype), m.to(dtype), v.to(dtype)]
        torch.ops.deepspeed.multi_tensor_adam(CHUNK, _noop(), [_dev(g) for g in grads], params, ms, vs,
                                              lr, b1, b2, eps, step, 1, 1, wd)
    for got, (want, _, _) in zip(params, ref):
        assert got.dtype == dtype
        # One storage rounding apart at most, compounded over the steps.
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_ext
@pytest.mark.parametrize("name", ["multi_tensor_adam", "multi_tensor_lion"])
def test_noop_flag_skips_the_step(ext, name):
    params = [_dev(torch.randn(s)) for s in SHAPES]
    states = [torch.ones_like(p) for p in params]
    before = [t.cpu() for t in params + states]
    grads = [torch.ones_like(p) for p in params]
    op = getattr(torch.ops.deepspeed, name)
    if name == "multi_tensor_adam":
        op(CHUNK, _noop(1), grads, params, states, [torch.ones_like(p) for p in params],
           1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    else:
        op(CHUNK, _noop(1), grads, params, states, 1e-2, 0.9, 0.99, 1, 0.0)
    for got, want in zip(params + states, before):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@needs_ext
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_multi_tensor_lion_matches_formula(ext, weight_decay):
    lr, b1, b2 = 1e-3, 0.9, 0.99
    init = [torch.randn(s) for s in SHAPES]
    ref = [[p.clone(), torch.zeros_like(p)] for p in init]
    params = [_dev(p) for p in init]
    exp_avgs = [torch.zeros_like(p) for p in params]
    for step, grads in enumerate(_grad_stream(40, seed=7), start=1):
        for state, g in zip(ref, grads):
            p, m = state
            c = b1 * m + (1 - b1) * g
            p = p * (1 - lr * weight_decay) - lr * torch.where(c > 0, 1.0, -1.0)
            state[:] = [p, b2 * m + (1 - b2) * g]
        torch.ops.deepspeed.multi_tensor_lion(CHUNK, _noop(), [_dev(g) for g in grads], params, exp_avgs,
                                              lr, b1, b2, step, weight_decay)
    for got, m, (want_p, want_m) in zip(params, exp_avgs, ref):
        torch.testing.assert_close(got.cpu(), want_p, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.cpu(), want_m, rtol=1e-5, atol=1e-6)
