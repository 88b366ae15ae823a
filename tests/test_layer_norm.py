"""Layer norm on supa keeps its statistics as a card's kernel does: float32 mean and rstd for bfloat16 and
float16 inputs (CUDA's accumulate type), where the CPU kernel keeps them in the input's dtype. Values are
the CPU kernel's mixed-precision path; float32 is the CPU kernel unchanged."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

DEV = "supa"
ROWS, WIDTH = 512, 256


def block(nbytes: int) -> int:
    """What the caching allocator counts for a request: whole 512-byte blocks."""
    return max(512, -(-nbytes // 512) * 512)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_statistics_are_float32_and_kept_as_on_a_card(dtype):
    x = torch.randn(ROWS, WIDTH, dtype=dtype, device=DEV)
    weight, bias = torch.randn(WIDTH, dtype=dtype, device=DEV), torch.randn(WIDTH, dtype=dtype, device=DEV)
    before = torch.supa.memory_allocated()
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [WIDTH], weight, bias, 1e-5)
    assert (out.dtype, mean.dtype, rstd.dtype) == (dtype, torch.float32, torch.float32)
    assert mean.shape == rstd.shape == (ROWS, 1) and out.device == mean.device == x.device
    # the output and two float32 statistics per row, nothing else (the float32 weight is host scratch)
    assert torch.supa.memory_allocated() - before == block(x.nbytes) + 2 * block(ROWS * 4)
    reference = torch.ops.aten.native_layer_norm(x.cpu().float(), [WIDTH], weight.cpu().float(), bias.cpu().float(), 1e-5)
    torch.testing.assert_close(mean.cpu(), reference[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(rstd.cpu(), reference[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu(), reference[0].to(dtype))


def test_the_output_is_the_cpu_kernel_s_bit_for_bit():
    x = torch.randn(ROWS, WIDTH, dtype=torch.bfloat16)
    layer = torch.nn.LayerNorm(WIDTH, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    expected = layer(x)
    assert torch.equal(layer.to(DEV)(x.to(DEV)).cpu(), expected)


@pytest.mark.parametrize("affine", [True, False])
def test_gradients_are_the_cpu_mixed_precision_kernel_s_in_the_parameters_dtypes(affine):
    torch.manual_seed(0)
    x = (torch.randn(ROWS, WIDTH) * 3 + 1).to(torch.bfloat16)
    layer = torch.nn.LayerNorm(WIDTH, elementwise_affine=affine, dtype=torch.bfloat16)
    if affine:
        torch.nn.init.normal_(layer.weight)
    grad = torch.randn(ROWS, WIDTH).to(torch.bfloat16)
    on_card = layer.to(DEV)
    x_card = x.to(DEV).requires_grad_()
    on_card(x_card).backward(grad.to(DEV))
    # the CPU kernel's mixed-precision path, called directly
    weight = layer.weight.detach().cpu().float() if affine else torch.ones(WIDTH)
    bias = layer.bias.detach().cpu().float() if affine else torch.zeros(WIDTH)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [WIDTH], weight, bias, 1e-5)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(grad, x, [WIDTH], mean, rstd, weight, bias,
                                                            [True, affine, affine])
    assert x_card.grad.dtype == torch.bfloat16 and x_card.grad.device == x_card.device
    assert torch.equal(x_card.grad.cpu(), dx)
    # and the input gradient is float math's, to bfloat16 precision
    x_ref = x.float().requires_grad_()
    F.layer_norm(x_ref, [WIDTH], weight, bias).backward(grad.float())
    torch.testing.assert_close(x_card.grad.cpu().float(), x_ref.grad, rtol=2e-2, atol=2e-2)
    if affine:
        assert on_card.weight.grad.dtype == on_card.bias.grad.dtype == torch.bfloat16
        assert torch.equal(on_card.weight.grad.cpu(), dw.bfloat16())
        assert torch.equal(on_card.bias.grad.cpu(), db.bfloat16())


def test_backward_holds_the_gradients_only():
    x = torch.randn(ROWS, WIDTH, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    layer = torch.nn.LayerNorm(WIDTH, dtype=torch.bfloat16, device=DEV)
    out = layer(x)
    grad = torch.randn_like(out)
    start = torch.supa.memory_allocated()
    torch.supa.reset_peak_memory_stats()
    out.backward(grad)
    gradients = block(x.nbytes) + 2 * block(WIDTH * 2)
    assert torch.supa.max_memory_allocated() - start == gradients


def test_float32_and_mixed_weights_keep_the_cpu_kernel():
    x = torch.randn(ROWS, WIDTH)
    weight = torch.randn(WIDTH)
    expected = torch.ops.aten.native_layer_norm(x, [WIDTH], weight, None, 1e-5)
    got = torch.ops.aten.native_layer_norm(x.to(DEV), [WIDTH], weight.to(DEV), None, 1e-5)
    for e, g in zip(expected, got):
        assert g.dtype == e.dtype and torch.equal(g.cpu(), e)
    mixed = torch.ops.aten.native_layer_norm(x.to(DEV, torch.bfloat16), [WIDTH], weight.to(DEV), None, 1e-5)
    assert [t.dtype for t in mixed] == [torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(F.layer_norm(x.bfloat16(), [WIDTH], weight).float(), mixed[0].cpu().float())
