"""Half and bfloat16 matrix products and convolutions on the emulated card accumulate in float32 and
round once, as a card's BLAS and convolution libraries do, through the host's float32 kernels
(supa_emu/csrc/aten/half_precision_products.cpp): the result equals the float32 product of the same
operands rounded to their type, for every overload (out=, in-place, batched, matrix-vector, dot,
convolution and its gradients). The host's own half/bfloat16 kernels accumulate in another order,
which the long reductions here make visible."""

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
pytestmark = pytest.mark.emulation_only

DEV = torch.device("supa", 0)
K = 2048  # long enough that the host's half-precision kernels round differently from float32's


def _operands(dtype, *shapes):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def _on_card(fn, *operands):
    return fn(*[t.to(DEV) for t in operands]).cpu()


def _in_float32(fn, *operands):
    return fn(*[t.float() for t in operands]).to(operands[0].dtype)


PRODUCTS = {
    "mm": (torch.mm, [(48, K), (K, 40)]),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0), [(40, ), (48, K), (K, 40)]),
    "addmm_gelu": (lambda c, a, b: torch.ops.aten._addmm_activation(c, a, b, use_gelu=True), [(40, ), (48, K),
                                                                                              (K, 40)]),
    "bmm": (torch.bmm, [(3, 16, K), (3, K, 24)]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5), [(3, 16, 24), (3, 16, K), (3, K, 24)]),
    "addmv": (torch.addmv, [(48, ), (48, K), (K, )]),
    "dot": (torch.dot, [(8 * K, ), (8 * K, )]),
    "vdot": (torch.vdot, [(8 * K, ), (8 * K, )]),
    # The input's gradient of a linear layer: grad_output @ weight, the layout backward multiplies in.
    "linear backward": (lambda x, w, grad: torch.autograd.grad(torch.nn.functional.linear(x.requires_grad_(), w),
                                                               x, grad)[0], [(32, 64), (K, 64), (32, K)]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", PRODUCTS)
def test_a_product_is_the_float32_product_rounded_once(name, dtype):
    fn, shapes = PRODUCTS[name]
    operands = _operands(dtype, *shapes)
    got = _on_card(fn, *operands)
    assert got.dtype == dtype
    torch.testing.assert_close(got, _in_float32(fn, *operands), rtol=0, atol=0)


def test_the_host_kernel_would_have_rounded_differently():
    # What makes the test above able to fail: the CPU's own bfloat16 kernel on the same operands.
    a, b = _operands(torch.bfloat16, (48, K), (K, 40))
    assert not torch.equal(a @ b, _in_float32(torch.mm, a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_and_in_place_forms_write_the_rounded_product_into_the_given_tensor(dtype):
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
def test_a_convolution_and_its_gradients_are_the_float32_ones_rounded_once(dtype):
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
