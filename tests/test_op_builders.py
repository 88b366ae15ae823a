"""Specification of the SUPA op builders (supa_deepspeed.op_builder.supa): discovery, is_compatible() and load().

Device-dependent tests use only public APIs (`torch.device('supa')`,
`deepspeed.accelerator.get_accelerator()`) and are skipped where no supa device exists.
"""

import importlib
import os
import pathlib
import shutil
import inspect
import pkgutil

import pytest

from harness import fresh_process
import torch

import supa_deepspeed.op_builder.supa as supa_builders
from supa_deepspeed.op_builder.supa import supa_kernels

# Builder class -> DeepSpeed op name (deepspeed 0.19.8's op_builder tree).
DEEPSPEED_NAMES = {
    'AsyncIOBuilder': 'async_io',
    'CPUAdagradBuilder': 'cpu_adagrad',
    'CPUAdamBuilder': 'cpu_adam',
    'CPULionBuilder': 'cpu_lion',
    'DeepCompileBuilder': 'dc',
    'EvoformerAttnBuilder': 'evoformer_attn',
    'FPQuantizerBuilder': 'fp_quantizer',
    'FusedAdamBuilder': 'fused_adam',
    'FusedLambBuilder': 'fused_lamb',
    'FusedLionBuilder': 'fused_lion',
    'GDSBuilder': 'gds',
    'InferenceBuilder': 'transformer_inference',
    'InferenceCoreBuilder': 'inference_core_ops',
    'InferenceCutlassBuilder': 'cutlass_ops',
    'PinMemoryBuilder': 'pin_memory',
    'QuantizerBuilder': 'quantizer',
    'RaggedOpsBuilder': 'ragged_device_ops',
    'RaggedUtilsBuilder': 'ragged_ops',
    'RandomLTDBuilder': 'random_ltd',
    'SpatialInferenceBuilder': 'spatial_inference',
    'StochasticTransformerBuilder': 'stochastic_transformer',
    'TransformerBuilder': 'transformer',
    'UtilsBuilder': 'utils',
}

NOT_IMPLEMENTED = ['DeepCompileBuilder', 'EvoformerAttnBuilder', 'FPQuantizerBuilder', 'GDSBuilder',
                   'InferenceCoreBuilder', 'InferenceCutlassBuilder', 'RaggedOpsBuilder', 'RaggedUtilsBuilder',
                   'RandomLTDBuilder', 'StochasticTransformerBuilder', 'TransformerBuilder', 'UtilsBuilder',
                   'NotImplementedBuilder']

# The deepspeed:: operators torch_supa_ext 2.12.0a1 registers (kernels and stubs).
REAL_EXT_OPS = set('''
layer_norm _layer_norm_residual layer_norm_residual_store_pre_ln_res multi_tensor_adam multi_tensor_lion nhwc_bias_add
nhwc_bias_add_add nhwc_bias_add_bias_add bias_gelu bias_add bias_relu bias_residual gated_activation _vector_add
moe_res_matmul residual_add_bias ds_quantize ds_quantize_asym quantize dequantize dequantize_fp32
dequantize_int4_to_half_experimental dequantize_int8_to_half_experimental lamb transformer_forward_fp32
transformer_forward_fp16 transformer_backward_fp32 transformer_backward_fp16 create_transformer_layer_fp32
create_transformer_layer_fp16 softmax softmax_context softmax_context_int8 qkv_gemm rms_qkv_gemm mlp_gemm rms_mlp_gemm
vector_matmul linear_layer fused_gemm_gelu rms_norm pre_rms_norm apply_rotary_pos_emb pad_transform einsum_sec_sm_ecm
allocate_workspace release_workspace retake_workspace reset_cache ds_sr_quantize ds_sr_quantize_asym swizzle_quant
quantized_reduction loco_swizzle_quant loco_quantized_reduction fp_quantize fp_dequantize fp_selective_dequantize
attention attention_bwd token_sort_ token_gather token_scatter_ mask_gather_bert mask_gather_gpt bias_activation_v2
blas_linear_v2 blas_4d_matmul layer_norm_v2 pre_layer_norm_v2 post_layer_norm_v2 rms_norm_v2 rms_pre_norm_v2
gated_activation_v2 wf6af16_linear preprocess_weight mixed_gemm moe_gemm mixed_moe_gemm build_atoms flash_attn_by_atoms
kv_rotary_embeddings linear_kv_copy ragged_embed gather_for_logits ds_moe_gather ds_moe_scatter top_k_gating
inference_all_reduce
'''.split())


def _supa_available():
    try:
        return hasattr(torch, 'supa') and torch.supa.is_available()
    except Exception:
        return False


def _discovered():
    """Builders as DeepSpeed finds them: module attributes ending in `Builder`, skipping builder.py."""
    found = {}
    for info in pkgutil.iter_modules(supa_builders.__path__):
        if info.name == 'builder':
            continue
        module = importlib.import_module(f'{supa_builders.__name__}.{info.name}')
        for name in dir(module):
            if name.endswith('Builder'):
                found[name] = getattr(module, name)
    return found


# ---- discovery ----------------------------------------------------------------------------------


def test_every_deepspeed_builder_name_is_discoverable():
    found = _discovered()
    assert set(DEEPSPEED_NAMES) <= set(found)
    for cls_name, op_name in DEEPSPEED_NAMES.items():
        assert found[cls_name]().name == op_name


def test_only_instantiable_builders_are_exposed_to_the_scan():
    # DeepSpeed instantiates every *Builder it finds with no arguments; bases must not leak.
    for name, cls in _discovered().items():
        assert inspect.isclass(cls), name
        instance = cls()
        assert isinstance(instance.is_compatible(), bool), name


def test_package_namespace_exposes_the_same_builders():
    for name in DEEPSPEED_NAMES:
        assert getattr(supa_builders, name) is _discovered()[name]


# ---- fused optimizers ------------------------------------------------------------------------------


@pytest.mark.parametrize('cls_name,functions', [('FusedAdamBuilder', ['multi_tensor_adam']),
                                                ('FusedLambBuilder', ['lamb']),
                                                ('FusedLionBuilder', ['multi_tensor_lion'])])
def test_fused_optimizer_builders_always_load(cls_name, functions):
    builder = getattr(supa_builders, cls_name)()
    assert builder.is_compatible() is True
    module = builder.load()
    for fn in functions:
        assert callable(getattr(module, fn))


def test_fused_adam_prefers_a_working_extension_kernel(monkeypatch):
    calls = []

    def fake_kernel(*args):
        calls.append(args)

    monkeypatch.setattr(supa_kernels, 'usable_kernel', lambda name, device, probe: fake_kernel)
    module = supa_builders.FusedAdamBuilder().load()
    p = [torch.ones(3)]
    module.multi_tensor_adam(2048, torch.zeros(1, dtype=torch.int32), [[torch.ones(3)], p, [torch.zeros(3)],
                                                                       [torch.zeros(3)]], 0.1, 0.9, 0.999, 1e-8, 1, 1,
                             1, 0.0)
    assert len(calls) == 1 and calls[0][0] == 2048 and calls[0][3] is p
    assert torch.equal(p[0], torch.ones(3))  # the fallback did not also run


def test_stub_extension_kernel_is_not_used(monkeypatch):
    # torch_supa_ext registers `lamb` as a stub raising NotImplementedError: the probe must reject it.
    def stub(*args):
        raise NotImplementedError("deepspeed::lamb not yet implemented on SUPA")

    monkeypatch.setattr(supa_kernels, 'registered_op', lambda name, namespace='deepspeed': stub)
    monkeypatch.setattr(supa_kernels, '_usable', {})
    from supa_deepspeed.op_builder.supa import fused_lamb
    assert supa_kernels.usable_kernel('lamb', torch.device('cpu'), fused_lamb._probe_ext_kernel) is None
    coeff = supa_builders.FusedLambBuilder().load().lamb(torch.ones(4), torch.empty(0), torch.zeros(4), torch.zeros(4),
                                                          torch.ones(4), 1e-2, 0.9, 0.999, 10.0, 0.01, 1e-8, 1.0, 1, 1,
                                                          1, 0.0)
    assert coeff.shape == (1, )


# ---- builders that raise --------------------------------------------------------------------------


@pytest.mark.parametrize('cls_name', NOT_IMPLEMENTED)
def test_unimplemented_builders_say_so_by_name(cls_name):
    builder = getattr(supa_builders, cls_name)()
    assert builder.is_compatible() is False
    with pytest.raises(NotImplementedError) as err:
        builder.load()
    assert builder.name in str(err.value) and 'SUPA' in str(err.value)


def test_async_io_reports_libaio():
    builder = supa_builders.AsyncIOBuilder()
    if builder.has_function('io_submit', ('aio', )):
        assert builder.is_compatible() is True
        pytest.skip('libaio is installed here; the missing-library path cannot be observed')
    assert builder.is_compatible() is False
    assert 'libaio' in builder.error_log
    with pytest.raises(RuntimeError, match='libaio-dev'):
        builder.load()


# ---- torch_supa_ext wrappers ---------------------------------------------------------------------


EXT_BUILDERS = ['InferenceBuilder', 'QuantizerBuilder', 'SpatialInferenceBuilder']


@pytest.mark.parametrize('cls_name', EXT_BUILDERS)
def test_extension_builders_only_name_real_torch_supa_ext_ops(cls_name):
    builder = getattr(supa_builders, cls_name)
    assert {op for op in builder.OPS.values() if op is not None} <= REAL_EXT_OPS


def test_inference_names_map_to_merged_operators():
    ops = supa_builders.InferenceBuilder.OPS
    assert ops['softmax_fp16'] == ops['softmax_bf16'] == ops['softmax_fp32'] == 'softmax'
    assert ops['allocate_workspace_fp16'] == 'allocate_workspace'
    assert ops['qkv_gemm_bf16'] == 'qkv_gemm'
    # The inference dequantize takes other arguments than the quantizer's `dequantize` operator.
    assert ops['dequantize_fp16'] is None


@pytest.mark.parametrize('cls_name', EXT_BUILDERS)
def test_extension_builders_without_torch_supa_ext(cls_name, monkeypatch):
    monkeypatch.setattr(supa_kernels, 'extension_status', lambda: (False, 'torch_supa_ext is not importable (test)'))
    builder = getattr(supa_builders, cls_name)()
    assert builder.is_compatible() is False
    with pytest.raises(ImportError, match='torch_supa_ext'):
        builder.load()


def _fake_extension(monkeypatch, registered):
    monkeypatch.setattr(supa_kernels, 'extension_status', lambda: (True, ''))

    def registered_op(name, namespace='deepspeed'):
        if name not in registered:
            return None

        def op(*args):
            return (name, args)

        return op

    monkeypatch.setattr(supa_kernels, 'registered_op', registered_op)


def test_inference_module_calls_the_merged_operator(monkeypatch):
    _fake_extension(monkeypatch, REAL_EXT_OPS)
    builder = supa_builders.InferenceBuilder()
    assert builder.is_compatible() is True
    module = builder.load()
    assert module.softmax_bf16(1, 2) == ('softmax', (1, 2))
    assert module.layer_norm('x') == ('layer_norm', ('x', ))


def test_inference_missing_op_error_names_it_and_lets_deepspeed_fall_back(monkeypatch):
    _fake_extension(monkeypatch, REAL_EXT_OPS)
    module = supa_builders.InferenceBuilder().load()
    with pytest.raises(AttributeError, match='add_padding_fp16'):
        module.add_padding_fp16
    with pytest.raises(NotImplementedError, match='repeat_kv_cache_bf16'):
        module.repeat_kv_cache_bf16


def test_unregistered_operator_makes_builder_incompatible(monkeypatch):
    _fake_extension(monkeypatch, REAL_EXT_OPS - {'qkv_gemm'})
    builder = supa_builders.InferenceBuilder()
    assert builder.is_compatible() is False
    assert 'qkv_gemm' in builder.error_log
    with pytest.raises(AttributeError, match=r'torch\.ops\.deepspeed\.qkv_gemm'):
        builder.load().qkv_gemm_fp16


def test_quantizer_module_has_deepspeeds_enum_values(monkeypatch):
    _fake_extension(monkeypatch, REAL_EXT_OPS)
    module = supa_builders.QuantizerBuilder().load()
    assert (module.Symmetric, module.Asymmetric) == (0, 1)
    assert module.ds_quantize_fp16('v', 1, 8) == ('ds_quantize', ('v', 1, 8))
    assert module.dequantize('q', 's', 1, 8, module.Symmetric) == ('dequantize', ('q', 's', 1, 8, 0))


def test_extension_builders_with_installed_torch_supa_ext():
    if not supa_kernels.extension_status()[0]:
        pytest.skip('torch_supa_ext is not importable here')
    for cls_name in EXT_BUILDERS:
        builder = getattr(supa_builders, cls_name)()
        assert builder.is_compatible() is True, builder.error_log
        builder.load()


# ---- host C++ builders ----------------------------------------------------------------------------


HOST_BUILDERS = ['CPUAdamBuilder', 'CPUAdagradBuilder', 'CPULionBuilder', 'PinMemoryBuilder', 'AsyncIOBuilder']


@pytest.mark.slow  # DeepSpeed probes the compiler and CPU for each flag list (about 4 s a builder)
@pytest.mark.parametrize('cls_name', HOST_BUILDERS)
def test_host_builders_build_exactly_like_deepspeeds_builtin_ones(cls_name):
    """Both accelerators JIT-build an op under one name into one torch-extensions directory, where
    ninja recompiles whenever the compile command changes: any difference in sources, include
    paths or flags would make every switch of SUPA_DS_ACCELERATOR rebuild the op."""
    builtin = getattr(importlib.import_module('deepspeed.ops.op_builder.supa'), cls_name)()
    ours = getattr(supa_builders, cls_name)()
    assert ours.name == builtin.name and ours.absolute_name() == builtin.absolute_name()
    for method in ('sources', 'include_paths', 'cxx_args', 'extra_ldflags'):
        assert getattr(ours, method)() == getattr(builtin, method)(), method


def _load_cpu_adam() -> str:
    """In a fresh interpreter: loads cpu_adam through DeepSpeed's accelerator; the builder's module."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder('CPUAdamBuilder')
    builder.load()
    return type(builder).__module__


@pytest.mark.slow
def test_switching_accelerators_does_not_rebuild_host_ops(cpu_adam_module, tmp_path):
    """One build of cpu_adam; then each accelerator loads it as it is (and ours says when it builds).

    The build starts from the objects this run already compiled (cpu_adam_module) without their
    library, so it is a link, not a minute of compiling: what is checked is who builds, not how.
    """
    ext_dir = tmp_path / 'torch_extensions'
    compiled = pathlib.Path(os.environ['TORCH_EXTENSIONS_DIR']) / 'cpu_adam'
    shutil.copytree(compiled, ext_dir / 'cpu_adam', ignore=shutil.ignore_patterns('*.so', 'lock'))
    env = {'TORCH_EXTENSIONS_DIR': str(ext_dir), 'DS_ACCELERATOR': 'supa', 'SUPA_EMULATE': '1'}

    def run(accelerator):
        result = fresh_process(_load_cpu_adam, env={**env, 'SUPA_DS_ACCELERATOR': accelerator}, timeout=1200)
        library = next(ext_dir.rglob('cpu_adam.so'))
        return result, library.stat().st_mtime_ns, (library.parent / '.ninja_log').read_text()

    first, built_at, log = run('project')
    assert first.value == 'supa_deepspeed.op_builder.supa.cpu_adam'
    assert "building DeepSpeed's cpu_adam op" in first.stderr and "built DeepSpeed's cpu_adam op" in first.stderr
    builtin, mtime, builtin_log = run('builtin')
    assert builtin.value == 'deepspeed.ops.op_builder.supa.cpu_adam'
    assert (mtime, builtin_log) == (built_at, log), "DeepSpeed's built-in accelerator rebuilt cpu_adam"
    again, mtime, again_log = run('project')
    assert (mtime, again_log) == (built_at, log), "switching back rebuilt cpu_adam"
    assert 'cpu_adam op' not in again.stderr


@pytest.fixture(scope='module')
def cpu_adam_module():
    return supa_builders.CPUAdamBuilder().load()


@pytest.mark.slow  # builds cpu_adam on first use
def test_deepspeed_cpu_adam_matches_torch_adamw(cpu_adam_module, monkeypatch):
    import deepspeed.ops.adam.cpu_adam as cpu_adam
    # Route DeepSpeedCPUAdam through this project's builder whatever accelerator is active.
    monkeypatch.setattr(cpu_adam, 'CPUAdamBuilder', supa_builders.CPUAdamBuilder)
    torch.manual_seed(0)
    init = [torch.randn(s) for s in [(64, ), (17, 9), (1000, )]]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = cpu_adam.DeepSpeedCPUAdam(ours, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, adamw_mode=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    for _ in range(50):
        grads = [torch.randn_like(t) for t in init]
        for q, r, g in zip(ours, ref, grads):
            q.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for q, r in zip(ours, ref):
        assert torch.allclose(q, r, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # builds the op on first use
@pytest.mark.parametrize('cls_name,functions', [('CPUAdagradBuilder', ['create_adagrad', 'adagrad_update']),
                                                ('CPULionBuilder', ['create_lion', 'lion_update'])])
def test_other_host_optimizers_build(cls_name, functions):
    builder = getattr(supa_builders, cls_name)()
    assert builder.is_compatible() is True
    module = builder.load()
    for fn in functions:
        assert callable(getattr(module, fn))


@pytest.mark.slow  # builds pin_memory on first use
def test_pin_memory_builds_and_is_shared_with_deepspeed():
    builder = supa_builders.PinMemoryBuilder()
    assert builder.is_compatible() is True
    assert builder.load() is builder.load()


# ---- DeepSpeed's optimizers on supa parameters -------------------------------------------------------

needs_supa = pytest.mark.skipif(not _supa_available(), reason='no supa device')


def _accelerator():
    from deepspeed.accelerator import get_accelerator
    accel = get_accelerator()
    if accel.device_name() != 'supa':
        pytest.skip(f"DeepSpeed's accelerator is {accel.device_name()!r}, not supa")
    return accel


def _train(opt_cls, ref_cls, steps=20, opt_kwargs=None, ref_step=None, device=None):
    if device is None:
        accel = _accelerator()
        device = torch.device('supa', 0)
        assert accel.device(0) == device
    torch.manual_seed(0)
    init = [torch.randn(s) for s in [(32, ), (8, 8), (300, )]]
    ours = [torch.nn.Parameter(t.to(device)) for t in init]
    opt = opt_cls(ours, **(opt_kwargs or {}))
    ref = [t.clone().double() for t in init]
    ref_state = [{} for _ in ref]
    for step in range(1, steps + 1):
        grads = [torch.randn_like(t) for t in init]
        for q, g in zip(ours, grads):
            q.grad = g.to(device)
        opt.step()
        for i, g in enumerate(grads):
            ref[i] = ref_step(ref[i], g.double(), ref_state[i], step)
    for q, r in zip(ours, ref):
        assert q.device.type == device.type
        torch.testing.assert_close(q.detach().cpu().double(), r, rtol=1e-5, atol=1e-6)


def _adamw_reference(p, g, st, step, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
    st['m'] = b1 * st.get('m', 0) + (1 - b1) * g
    st['v'] = b2 * st.get('v', 0) + (1 - b2) * g * g
    update = (st['m'] / (1 - b1**step)) / ((st['v'] / (1 - b2**step)).sqrt() + eps) + wd * p
    return p - lr * update


def test_deepspeed_fused_adam_class_with_this_builder_on_cpu(monkeypatch):
    # DeepSpeed's own FusedAdam driving this project's op on CPU tensors, whatever accelerator is active.
    import deepspeed.ops.adam.fused_adam as ds_fused_adam
    monkeypatch.setattr(ds_fused_adam, 'FusedAdamBuilder', supa_builders.FusedAdamBuilder)
    _train(ds_fused_adam.FusedAdam, None, opt_kwargs=dict(lr=1e-3, weight_decay=0.01), ref_step=_adamw_reference,
           device=torch.device('cpu'))


@needs_supa
def test_deepspeed_fused_adam_on_supa():
    from deepspeed.ops.adam import FusedAdam

    def adamw(p, g, st, step, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01):
        st['m'] = b1 * st.get('m', 0) + (1 - b1) * g
        st['v'] = b2 * st.get('v', 0) + (1 - b2) * g * g
        update = (st['m'] / (1 - b1**step)) / ((st['v'] / (1 - b2**step)).sqrt() + eps) + wd * p
        return p - lr * update

    _train(FusedAdam, torch.optim.AdamW, opt_kwargs=dict(lr=1e-3, weight_decay=0.01), ref_step=adamw)


@needs_supa
def test_deepspeed_fused_lion_on_supa():
    from deepspeed.ops.lion import FusedLion

    def lion(p, g, st, step, lr=1e-3, b1=0.9, b2=0.99, wd=0.01):
        m = st.get('m', torch.zeros_like(p))
        c = b1 * m + (1 - b1) * g
        st['m'] = b2 * m + (1 - b2) * g
        return p * (1 - lr * wd) + torch.where(c > 0, -lr, lr)

    _train(FusedLion, None, opt_kwargs=dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.99)), ref_step=lion)


@needs_supa
def test_deepspeed_fused_lamb_on_supa():
    from deepspeed.ops.lamb import FusedLamb

    def lamb(p, g, st, step, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
        st['m'] = b1 * st.get('m', 0) + (1 - b1) * g
        st['v'] = b2 * st.get('v', 0) + (1 - b2) * g * g
        update = st['m'] / (st['v'].sqrt() + eps) + wd * p
        w, u = p.norm().item(), update.norm().item()
        coeff = min(max(w / u, 0.01), 10.0) if w and u else 1.0
        return p - lr * (1 - b2**step)**0.5 / (1 - b1**step) * coeff * update

    _train(FusedLamb, None, opt_kwargs=dict(lr=1e-3), ref_step=lamb)
