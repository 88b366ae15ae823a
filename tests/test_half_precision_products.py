"""Half and bfloat16 matrix products and convolutions on the emulated card accumulate in float32 and
round once, as a card's BLAS and convolution libraries do (supa_emu/csrc/aten/half_precision_products.cpp).
Two host paths keep that arithmetic, chosen per type at activation from the CPU's flags:

- float32 copies through the host's float32 kernels (every host; the only path on one without
  bfloat16/float16 matrix instructions): the result equals the float32 product of the same operands
  rounded to their type, bit for bit, for every overload (out=, in-place, batched, matrix-vector,
  dot, convolution and its gradients).
- the CPU's own kernel (oneDNN) for matrix-matrix products and convolutions, on a host whose CPU
  has the type's matrix instructions (AVX512_BF16 or AMX_BF16; AVX512_FP16 or AMX_FP16): float32
  accumulation in another order. The result is a float32 sum of the same products rounded once: it
  lies between the roundings of the exact product minus and plus the error bound of float32
  summation (`assert_a_float32_sum_rounded_once`).

The long reductions here make the two orders, and any rounding on the way, visible."""

import pytest
import torch

from supa_emu import process_state

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
pytestmark = pytest.mark.emulation_only

DEV = torch.device("supa", 0)
K = 2048  # long enough that the host's half-precision kernels round differently from float32's
HOST_FLAGS = {name for name, value in torch._C._cpu._get_cpu_capability().items() if value is True}
WITH_MATRIX_INSTRUCTIONS = {"avx512_bf16", "avx512_fp16"}  # a host where both types take the CPU's kernels


def _choose(flags=None):
    """The types whose products take the CPU's own kernels, chosen from `flags` (None: this host's)."""
    core = process_state.core()
    return core._choose_half_precision_kernels() if flags is None else core._choose_half_precision_kernels(flags)


@pytest.fixture
def float32_path():
    """Every half-precision product on float32 copies, as on a host without matrix instructions."""
    assert _choose(set()) == []
    yield
    _choose()


@pytest.fixture
def chosen_on_this_host():
    """The types this host's CPU kernels run (the choice activation made)."""
    return {getattr(torch, name) for name in _choose()}


def _operands(dtype, *shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def _on_card(fn, *operands):
    return fn(*[t.to(DEV) for t in operands]).cpu()


def _in_float32(fn, *operands):
    return fn(*[t.float() for t in operands]).to(operands[0].dtype)


def assert_a_float32_sum_rounded_once(got, fn, operands, terms):
    """`got` is fn's float32 result on `operands`, summed in any order, rounded once to their type.

    A product of two half or bfloat16 numbers is exact in float32 (11 + 11 significant bits <= 24),
    so a float32 sum of n of them, in any order and grouping, with the alpha/beta scalings counted
    as two more operations, is within gamma(n + 2) * sum|term| of the exact value (Higham, Accuracy
    and Stability of Numerical Algorithms, 4.2; gamma(n) = n u / (1 - n u), u = 2^-24): fn on the
    magnitudes in float64 gives the sum of |term|. Rounding is monotonic, so the result lies between
    the roundings of the interval's ends. (randn operands keep the sums far from float32's
    subnormals, which AVX512_BF16's dot product flushes to zero.)
    """
    u = 2.0 ** -24
    gamma = (terms + 2) * u / (1 - (terms + 2) * u)
    exact = fn(*[t.double() for t in operands])
    spread = gamma * fn(*[t.double().abs() for t in operands]).abs()
    low, high = ((exact + sign * spread).float().to(got.dtype).double() for sign in (-1, 1))
    outside = (got.double() < low) | (got.double() > high)
    assert not outside.any(), f"{int(outside.sum())} of {got.numel()} elements are no float32 sum rounded once"


# name: (fn, operand shapes, float32 terms summed per result element)
PRODUCTS = {
    "mm": (torch.mm, [(48, K), (K, 40)], K),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [(40, ), (48, K), (K, 40)], K + 1),
    "addmm_gelu": (lambda c, a, b: torch.ops.aten._addmm_activation(c, a, b, use_gelu=True), [(40, ), (48, K),
                                                                                              (K, 40)], None),
    "bmm": (torch.bmm, [(3, 16, K), (3, K, 24)], K),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5), [(3, 16, 24), (3, 16, K), (3, K, 24)], K + 1),
    "addmv": (torch.addmv, [(48, ), (48, K), (K, )], K + 1),
    "dot": (torch.dot, [(8 * K, ), (8 * K, )], 8 * K),
    "vdot": (torch.vdot, [(8 * K, ), (8 * K, )], 8 * K),
    # The input's gradient of a linear layer: grad_output @ weight, the layout backward multiplies in.
    "linear backward": (lambda x, w, grad: torch.autograd.grad(torch.nn.functional.linear(x.requires_grad_(), w),
                                                               x, grad)[0], [(32, 64), (K, 64), (32, K)], K),
}
# Where chosen, these take the CPU's own kernel; the rest stay on float32 copies on every host: the
# CPU's vector products are slow in half precision, and its _addmm_activation rounds before the GELU.
ON_CPU_KERNELS = {"mm", "addmm", "bmm", "baddbmm", "linear backward"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", PRODUCTS)
def test_on_float32_copies_a_product_is_the_float32_product_rounded_once(name, dtype, float32_path):
    fn, shapes, _ = PRODUCTS[name]
    operands = _operands(dtype, *shapes)
    got = _on_card(fn, *operands)
    assert got.dtype == dtype
    torch.testing.assert_close(got, _in_float32(fn, *operands), rtol=0, atol=0)


def test_the_host_kernel_would_have_rounded_differently():
    # What makes the test above able to fail: the CPU's own bfloat16 kernel on the same operands.
    a, b = _operands(torch.bfloat16, (48, K), (K, 40))
    assert not torch.equal(a @ b, _in_float32(torch.mm, a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", PRODUCTS)
def test_with_matrix_instructions_a_product_is_a_float32_sum_rounded_once(name, dtype, chosen_on_this_host):
    if dtype not in chosen_on_this_host:
        pytest.skip(f"this CPU has no {dtype} matrix instructions: its products take float32 copies (tested above)")
    fn, shapes, terms = PRODUCTS[name]
    operands = _operands(dtype, *shapes)
    got = _on_card(fn, *operands)
    assert got.dtype == dtype
    if name in ON_CPU_KERNELS:
        assert torch.equal(got, fn(*operands))  # the CPU's own kernel, bit for bit
        assert_a_float32_sum_rounded_once(got, fn, operands, terms)
    else:
        torch.testing.assert_close(got, _in_float32(fn, *operands), rtol=0, atol=0)


def test_the_bound_rejects_a_sum_rounded_on_the_way():
    # What makes the test above able to fail: partial sums rounded to bfloat16 every 256 terms.
    a, b = _operands(torch.bfloat16, (48, K), (K, 40))
    partial = torch.zeros(48, 40, dtype=torch.bfloat16)
    for k in range(0, K, 256):
        partial = (partial.float() + a[:, k:k + 256].float() @ b[k:k + 256].float()).to(torch.bfloat16)
    assert_a_float32_sum_rounded_once(_in_float32(torch.mm, a, b), torch.mm, [a, b], K)
    with pytest.raises(AssertionError, match="no float32 sum rounded once"):
        assert_a_float32_sum_rounded_once(partial, torch.mm, [a, b], K)


# flags (at::cpu::get_cpu_capabilities()'s names) -> the types whose products take the CPU's kernels
CHOICES = [
    (set(), []),
    ({"avx2", "fma3", "f16c"}, []),  # an AVX2 host: no half-precision matrix instructions
    ({"avx512_f", "avx512_bw", "avx512_vnni"}, []),  # AVX-512 without BF16: oneDNN would emulate it
    ({"avx512_f", "avx512_bf16"}, ["bfloat16"]),  # VDPBF16PS (AMD Zen 4, Intel Cooper Lake)
    ({"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}, ["bfloat16", "float16"]),  # Sapphire Rapids
    ({"amx_bf16", "amx_fp16"}, ["bfloat16", "float16"]),
]


@pytest.mark.parametrize("flags, chosen", CHOICES, ids=lambda v: "+".join(sorted(v)) or "none")
def test_the_choice_follows_the_cpu_s_flags(flags, chosen):
    try:
        assert _choose(flags) == chosen
    finally:
        _choose()


def test_activation_chose_from_this_host_s_flags():
    instructions = {"bfloat16": {"avx512_bf16", "amx_bf16"}, "float16": {"avx512_fp16", "amx_fp16"}}
    assert _choose() == [name for name, flags in instructions.items() if flags & HOST_FLAGS]
    a, b = _operands(torch.bfloat16, (48, K), (K, 40))
    on_cpu_kernel = bool(instructions["bfloat16"] & HOST_FLAGS)
    assert torch.equal(_on_card(torch.mm, a, b), a @ b if on_cpu_kernel else _in_float32(torch.mm, a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_and_in_place_forms_write_the_rounded_product_into_the_given_tensor(dtype, float32_path):
    a, b, c = _operands(dtype, (48, K), (K, 40), (48, 40))
    expected = _in_float32(torch.mm, a, b)

    out = torch.empty(40, 48, dtype=dtype, device=DEV).t()  # column-major: the layout is kept
    assert torch.mm(a.to(DEV), b.to(DEV), out=out) is out
    assert out.stride() == (1, 48)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)

    resized = torch.empty(0, dtype=dtype, device=DEV)
    torch.mm(a.to(DEV), b.to(DEV), out=resized)
    torch.testing.assert_close(resized.cpu(), expected, rtol=0, atol=0)

    accumulated = c.to(DEV)
    assert accumulated.addmm_(a.to(DEV), b.to(DEV), beta=0.25) is accumulated
    torch.testing.assert_close(accumulated.cpu(), _in_float32(lambda c, a, b: c.addmm(a, b, beta=0.25), c, a, b),
                               rtol=0, atol=0)


def test_addbmm_rounds_after_each_batch_as_the_host_kernel_does():
    # A card's addbmm adds the batches' products one by one (CUDA's kernel does), each rounded.
    c, a, b = _operands(torch.bfloat16, (16, 24), (4, 16, K), (4, K, 24))
    torch.testing.assert_close(_on_card(torch.addbmm, c, a, b), torch.addbmm(c, a, b), rtol=0, atol=0)


def test_mixed_types_are_refused_as_on_the_host():
    a, b = _operands(torch.bfloat16, (4, 8), (8, 4))
    with pytest.raises(RuntimeError) as on_host:
        torch.mm(a, b.float())
    with pytest.raises(RuntimeError) as on_card:
        torch.mm(a.to(DEV), b.float().to(DEV))
    assert str(on_card.value) == str(on_host.value)


def test_an_output_dtype_overload_keeps_the_host_kernel_s_answer():
    a, b = _operands(torch.bfloat16, (8, 16), (16, 8))
    try:
        expected = torch.mm(a, b, out_dtype=torch.float32)
    except RuntimeError as on_host:
        with pytest.raises(RuntimeError) as on_card:
            torch.mm(a.to(DEV), b.to(DEV), out_dtype=torch.float32)
        assert str(on_card.value) == str(on_host)
    else:
        torch.testing.assert_close(torch.mm(a.to(DEV), b.to(DEV), out_dtype=torch.float32).cpu(), expected,
                                   rtol=0, atol=0)


# ---- convolutions ---------------------------------------------------------------------------------
CONV = dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False, output_padding=[0, 0], groups=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_on_float32_copies_a_convolution_and_its_gradients_are_the_float32_ones_rounded_once(dtype, float32_path):
    # 256 input channels x 3x3: a reduction of 2304 products per output element.
    x, w, b, grad = _operands(dtype, (2, 256, 8, 8), (16, 256, 3, 3), (16, ), (2, 16, 8, 8))
    forward = lambda x, w, b: torch.ops.aten.convolution(x, w, b, **CONV)  # noqa: E731
    torch.testing.assert_close(_on_card(forward, x, w, b), _in_float32(forward, x, w, b), rtol=0, atol=0)

    def backward(grad, x, w):
        return torch.ops.aten.convolution_backward(grad, x, w, [16], *CONV.values(), [True, True, True])

    on_card = backward(grad.to(DEV), x.to(DEV), w.to(DEV))
    in_float32 = backward(grad.float(), x.float(), w.float())
    for got, expected in zip(on_card, in_float32, strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.cpu(), expected.to(dtype), rtol=0, atol=0)

    # Unrequested gradients stay absent; a module's backward takes the same path.
    grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        grad.to(DEV), x.to(DEV), w.to(DEV), [16], *CONV.values(), [True, False, False])
    assert grad_weight is None and grad_bias is None
    torch.testing.assert_close(grad_input.cpu(), in_float32[0].to(dtype), rtol=0, atol=0)
    conv = torch.nn.Conv2d(256, 16, 3, padding=1).to(DEV, dtype)
    conv.weight.data.copy_(w.to(DEV))
    conv.bias.data.copy_(b.to(DEV))
    conv(x.to(DEV)).backward(grad.to(DEV))
    torch.testing.assert_close(conv.weight.grad.cpu(), in_float32[1].to(dtype), rtol=0, atol=0)


def _convolution_backward(grad, x, w, **conv):
    return torch.ops.aten.convolution_backward(grad, x, w, [w.shape[1] if conv["transposed"] else w.shape[0]],
                                               *conv.values(), [True, True, True])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_with_matrix_instructions_a_convolution_and_its_gradients_are_float32_sums_rounded_once(
        dtype, chosen_on_this_host):
    if dtype not in chosen_on_this_host:
        pytest.skip(f"this CPU has no {dtype} matrix instructions: its convolutions take float32 copies")
    x, w, b, grad = _operands(dtype, (2, 256, 8, 8), (16, 256, 3, 3), (16, ), (2, 16, 8, 8))
    forward = lambda x, w, b: torch.ops.aten.convolution(x, w, b, **CONV)  # noqa: E731
    got = _on_card(forward, x, w, b)
    assert torch.equal(got, forward(x, w, b))
    assert_a_float32_sum_rounded_once(got, forward, [x, w, b], 256 * 9 + 1)

    on_card = _convolution_backward(grad.to(DEV), x.to(DEV), w.to(DEV), **CONV)
    # Terms per element: grad_input 16 channels x 3x3, grad_weight and grad_bias 2 x 8x8 positions.
    for i, terms in enumerate([16 * 9, 2 * 8 * 8, 2 * 8 * 8]):
        assert torch.equal(on_card[i].cpu(), _convolution_backward(grad, x, w, **CONV)[i])
        assert_a_float32_sum_rounded_once(on_card[i].cpu(), lambda *t: _convolution_backward(*t, **CONV)[i],
                                           [grad, x, w], terms)


# A transposed convolution whose output padding reaches the stride: PyTorch's CPU kernel for it is
# not oneDNN's and rounds partial sums, like every half-precision CPU kernel with oneDNN switched off.
TRANSPOSED = dict(stride=[1, 1], padding=[1, 1], dilation=[2, 2], transposed=True, output_padding=[1, 1], groups=1)


@pytest.mark.parametrize("onednn", [True, False], ids=["large output padding", "oneDNN off"])
def test_where_the_cpu_kernel_would_round_partial_sums_products_take_float32_copies(onednn):
    conv = TRANSPOSED if onednn else CONV
    x, w, grad = _operands(torch.bfloat16, (2, 256, 8, 8), (256, 16, 3, 3) if onednn else (16, 256, 3, 3),
                           (2, 16, 11, 11) if onednn else (2, 16, 8, 8))
    try:
        _choose(WITH_MATRIX_INSTRUCTIONS)
        # The flags() context: setting the flag directly is refused once a test module of PyTorch's
        # own test helpers (common_utils) froze the global flags in this process.
        with torch.backends.mkldnn.flags(enabled=onednn):
            on_card = _convolution_backward(grad.to(DEV), x.to(DEV), w.to(DEV), **conv)
            on_cpu_kernel = _convolution_backward(grad, x, w, **conv)
            in_float32 = _convolution_backward(grad.float(), x.float(), w.float(), **conv)
    finally:
        _choose()
    for got, cpu, expected in zip(on_card, on_cpu_kernel, in_float32, strict=True):
        torch.testing.assert_close(got.cpu(), expected.to(torch.bfloat16), rtol=0, atol=0)
    assert not all(torch.equal(cpu, expected.to(torch.bfloat16)) for cpu, expected in zip(on_cpu_kernel, in_float32))
