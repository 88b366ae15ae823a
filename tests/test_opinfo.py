"""Every operator of PyTorch's own OpInfo database (`op_db`) runs on supa with the CPU result.

For each op: a few float32 samples (or the op's first supported dtype when it has no float32
kernel on CPU) and one bfloat16 sample where the CPU supports bfloat16, made on supa and run
there and on a CPU copy of the sample, and compared; plus the gradients of the inputs for
ops that support autograd. Ops that draw random numbers or return uninitialised memory are
compared on shape, dtype and device only. Results must be on the supa device of the inputs.
An op that cannot match the CPU is listed in EXPECTED_FAILURES with the reason.
"""

import itertools
import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

pytestmark = pytest.mark.emulation_only  # the CPU reference runs in the same process

DEV = torch.device("supa", 0)
FLOAT32_SAMPLES = 2  # per op; the database has up to hundreds, each runs a whole op on both sides
OTHER_DTYPE_SAMPLES = 1

# Ops whose results are random (a card's numbers are not the CPU's) or uninitialised memory: compared on
# shape, dtype and device.
UNDETERMINED_VALUES = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal", "normal.in_place",
    "normal.number_mean", "uniform", "rand_like", "randint", "randint_like", "randn", "randn_like",
    "nn.functional.alpha_dropout", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
    # random inside: pooling regions drawn with torch.rand, attention dropout (training=True samples)
    "nn.functional.fractional_max_pool3d", "nn.functional.multi_head_attention_forward",
    "empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided",
}

# Ops whose card kernel returns some results in a wider dtype than the CPU kernel: result positions that are
# float32 on supa where the CPU gives bfloat16 or float16. Compared with the CPU's values at the CPU dtype's
# tolerance.
CARD_FLOAT_RESULTS = {
    "native_layer_norm": {1, 2},  # mean and rstd, saved in float32 as by CUDA's kernel (docs/operator_memory.md)
}

# Ops whose half-precision results on the card are their float32 computation rounded once, where the CPU's
# half-precision kernel rounds partial sums (transposed convolutions add overlapping patches in the result's
# dtype): compared with the CPU's result in float32 on the same operands, rounded to the dtype
# (docs/device_model.md#operators).
FLOAT32_ACCUMULATION = {"nn.functional.conv_transpose2d", "nn.functional.conv_transpose3d"}

# Ops that do not give the CPU result on supa, with the reason. The goal is an empty table.
EXPECTED_FAILURES: dict[str, str] = {}


def _op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _dtypes(op) -> list[torch.dtype]:
    supported = op.supported_dtypes("cpu")
    if torch.float32 in supported:
        first = torch.float32
    else:  # integer-only ops and the like; float64 has no place on a SUPA card
        candidates = [d for d in (torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64,
                                  torch.float16, torch.int16, torch.int8, torch.float8_e4m3fn) if d in supported]
        if not candidates:
            return []
        first = candidates[0]
    return [first] + ([torch.bfloat16] if torch.bfloat16 in supported and first != torch.bfloat16 else [])


def _moved(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device` with its whole storage, so that views (as_strided samples) see the same memory."""
    if tensor.layout != torch.strided:
        return tensor.detach().to(device).requires_grad_(tensor.requires_grad)
    storage = tensor.untyped_storage()
    whole = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        storage, 0, (storage.nbytes() // tensor.element_size(),), (1,))
    moved = whole.detach().to(device).as_strided(tensor.size(), tensor.stride(), tensor.storage_offset()).detach()
    if tensor.is_conj():
        moved = moved.conj()
    if tensor.is_neg():
        moved = torch._neg_view(moved)
    return moved.requires_grad_(tensor.requires_grad)


def _to_cpu(value):
    """The CPU twin of a supa sample: supa tensors moved (leaves stay leaves), supa device arguments turned to CPU."""
    if isinstance(value, torch.Tensor):
        return _moved(value, "cpu") if value.device.type == "supa" else value
    if isinstance(value, torch.device) and value.type == "supa":
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("supa"):
        return "cpu"
    return value


def _tensors(tree):
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _run(op, sample):
    out = op(sample.input, *sample.args, **sample.kwargs)
    return out


def _check_placement(expected, got, where):
    for e, g in zip(_tensors(expected), _tensors(got)):
        if e.device.type == "cpu":
            assert g.device == DEV, f"{where}: a result landed on {g.device}, expected {DEV}"


def _compare(expected, got, values: bool, where: str, card_float: frozenset = frozenset()):
    flat_expected, spec_expected = tree_flatten(expected)
    flat_got, spec_got = tree_flatten(got)
    assert spec_expected == spec_got, f"{where}: result structure {spec_got} != CPU's {spec_expected}"
    for position, (e, g) in enumerate(zip(flat_expected, flat_got)):
        if position in card_float and isinstance(e, torch.Tensor) and e.dtype in (torch.bfloat16, torch.float16):
            assert g.dtype == torch.float32 and g.shape == e.shape, f"{where}: result {position} is {g.dtype} " \
                f"{tuple(g.shape)}, expected float32 {tuple(e.shape)} (the card's kernel keeps it in float32)"
            tolerance = {"rtol": 1.6e-2, "atol": 1e-5} if e.dtype == torch.bfloat16 else {"rtol": 1e-3, "atol": 1e-5}
            torch.testing.assert_close(g.detach().cpu(), e.detach().float(), equal_nan=True, **tolerance,
                                       msg=lambda m: f"{where}, result {position}: {m}")
            continue
        if not isinstance(e, torch.Tensor):
            if values and not isinstance(e, (torch.dtype, torch.device, torch.Size)):
                assert e == g or (e != e and g != g), f"{where}: {g!r} != CPU's {e!r}"
            continue
        assert isinstance(g, torch.Tensor), f"{where}: got {type(g)} where CPU gives a tensor"
        assert g.shape == e.shape and g.dtype == e.dtype and g.layout == e.layout, (
            f"{where}: {tuple(g.shape)} {g.dtype} {g.layout} != CPU's {tuple(e.shape)} {e.dtype} {e.layout}")
        if values and e.layout == torch.strided:
            torch.testing.assert_close(g.detach().cpu(), e.detach(), equal_nan=True, msg=lambda m: f"{where}: {m}")
        elif values:
            torch.testing.assert_close(g.detach().cpu().to_dense(), e.detach().to_dense(), equal_nan=True,
                                       msg=lambda m: f"{where}: {m}")


def _differentiable(tensors):
    return [t for t in tensors if t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _check_backward(sample, supa_sample, expected, got, where):
    expected = sample.output_process_fn_grad(expected)
    got = supa_sample.output_process_fn_grad(got)
    outputs = [(e, g) for e, g in zip(_tensors(expected), _tensors(got))
               if e.requires_grad and (e.is_floating_point() or e.is_complex())]
    inputs = _differentiable(_tensors((sample.input, sample.args, sample.kwargs)))
    supa_inputs = _differentiable(_tensors((supa_sample.input, supa_sample.args, supa_sample.kwargs)))
    if not outputs or not inputs:
        return
    assert len(inputs) == len(supa_inputs)
    # Drawn in float32 and cast on each side: float64 data may not be copied to a SUPA card.
    weights = [torch.randn(e.shape, dtype=torch.complex64 if e.is_complex() else torch.float32)
               for e, _ in outputs]
    expected_grads = torch.autograd.grad([e for e, _ in outputs], inputs,
                                         [w.to(e.dtype) for w, (e, _) in zip(weights, outputs)], allow_unused=True)
    got_grads = torch.autograd.grad([g for _, g in outputs], supa_inputs,
                                    [w.to(DEV).to(g.dtype) for w, (_, g) in zip(weights, outputs)], allow_unused=True)
    for i, (e, g) in enumerate(zip(expected_grads, got_grads)):
        assert (e is None) == (g is None), f"{where}: gradient of input {i} defined on one side only"
        if e is not None:
            assert g.device == DEV, f"{where}: gradient of input {i} landed on {g.device}"
            torch.testing.assert_close(g.cpu(), e, equal_nan=True, msg=lambda m: f"{where}, gradient {i}: {m}")


def _check_sample(op, sample, dtype, index, backward):
    op_id = _op_id(op)
    where = f"{op_id} {dtype} sample {index}"
    cpu_sample = sample.transform(_to_cpu)
    cpu_sample.args = tree_map(_to_cpu, cpu_sample.args)
    cpu_sample.kwargs = tree_map(_to_cpu, cpu_sample.kwargs)
    rounded_from_float32 = op_id in FLOAT32_ACCUMULATION and dtype in (torch.bfloat16, torch.float16)
    if rounded_from_float32:
        cpu_sample = cpu_sample.transform(lambda t: t.float() if t.dtype == dtype else t)
    try:
        expected = _run(op, cpu_sample)
    except Exception as cpu_error:  # the sample is invalid on CPU: supa must refuse it too
        with pytest.raises(type(cpu_error)):
            _run(op, sample)
        return
    if rounded_from_float32:
        expected = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t,
                            expected)
    got = _run(op, sample)
    values = op_id not in UNDETERMINED_VALUES
    _check_placement(expected, got, where)
    _compare(expected, got, values, where, frozenset(CARD_FLOAT_RESULTS.get(op_id, ())))
    if backward and values:
        _check_backward(cpu_sample, sample, expected, got, where)


def _params():
    for op in op_db:
        op_id = _op_id(op)
        marks = [pytest.mark.xfail(reason=EXPECTED_FAILURES[op_id], strict=True)] if op_id in EXPECTED_FAILURES else []
        yield pytest.param(op, id=op_id, marks=marks)


@pytest.mark.parametrize("op", _params())
def test_op_matches_cpu(op):
    dtypes = _dtypes(op)
    if not dtypes:
        pytest.skip(f"{_op_id(op)} has no dtype a SUPA card supports on CPU")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in dtypes:
            count = FLOAT32_SAMPLES if dtype == torch.float32 else OTHER_DTYPE_SAMPLES
            backward = op.supports_autograd and dtype == torch.float32
            # sample_inputs_func directly: op.sample_inputs wraps it in a tracker that crawls the
            # interpreter stack for every sample (most of the run time under pytest).
            # Samples are made on supa, as PyTorch's device tests make them on the device under
            # test (arguments an op wants on the CPU stay there); the reference is their CPU copy.
            samples = op.sample_inputs_func(op, "supa", dtype, backward)
            for index, sample in enumerate(itertools.islice(samples, count)):
                _check_sample(op, sample, dtype, index, backward)
