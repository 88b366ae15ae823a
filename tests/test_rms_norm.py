"""RMS norm on supa runs as a card's fused operators (aten::_fused_rms_norm and its backward, which a GPU
has kernels for and the CPU decomposes), with the CPU's values bit for bit and the card's memory: the
output and float32 rstd per row, no float32 copies of the input kept for backward."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

DEV = "supa"
ROWS, WIDTH = 512, 256


def block(nbytes: int) -> int:
    """What the caching allocator counts for a request: whole 512-byte blocks."""
    return max(512, -(-nbytes // 512) * 512)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_and_gradients_are_the_cpu_s_bit_for_bit(dtype, affine):
    torch.manual_seed(0)
    x = (torch.randn(4, ROWS // 4, WIDTH) * 3 + 1).to(dtype)
    weight = torch.randn(WIDTH).to(dtype) if affine else None
    grad = torch.randn(4, ROWS // 4, WIDTH).to(dtype)

    def run(device):
        x_ = x.to(device).requires_grad_()
        w_ = weight.to(device).requires_grad_() if affine else None
        out = F.rms_norm(x_, [WIDTH], w_, 1e-5)
        out.backward(grad.to(device))
        return [t.cpu() for t in (out, x_.grad, *([w_.grad] if affine else []))]

    for on_card, on_cpu in zip(run(DEV), run("cpu")):
        assert on_card.dtype == on_cpu.dtype
        assert torch.equal(on_card, on_cpu)


def test_profiler_and_autograd_name_the_cards_operators():
    layer = torch.nn.RMSNorm(WIDTH, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(ROWS, WIDTH, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    with torch.profiler.profile() as prof:
        out = layer(x)
        out.sum().backward()
    names = {e.name for e in prof.events()}
    assert {"aten::_fused_rms_norm", "aten::_fused_rms_norm_backward"} <= names
    # the host computation that stands in for the card's kernel is not the card's
    assert not names & {"aten::pow", "aten::rsqrt", "aten::mean"}
    assert out.grad_fn.name() == "FusedRmsNormBackward0"


def test_forward_returns_and_keeps_what_a_card_does():
    x = torch.randn(ROWS, WIDTH, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    weight = torch.randn(WIDTH, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    out, rstd = torch.ops.aten._fused_rms_norm(x.detach(), [WIDTH], weight.detach(), 1e-5)
    assert (out.dtype, rstd.dtype, tuple(rstd.shape)) == (torch.bfloat16, torch.float32, (ROWS, 1))
    del out, rstd
    before = torch.supa.memory_allocated()
    out = F.rms_norm(x, [WIDTH], weight, 1e-5)
    # until backward: the output and float32 rstd per row; the decomposition kept two float32 copies
    # of the input besides
    assert torch.supa.memory_allocated() - before == block(x.nbytes) + block(ROWS * 4)
    assert out.grad_fn.name() == "FusedRmsNormBackward0"


def test_backward_holds_the_gradients_only():
    x = torch.randn(ROWS, WIDTH, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    weight = torch.randn(WIDTH, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    out = F.rms_norm(x, [WIDTH], weight, 1e-5)
    grad = torch.randn_like(out)
    torch.supa.reset_peak_memory_stats()
    before = torch.supa.memory_allocated()
    out.backward(grad)
    assert torch.supa.max_memory_allocated() - before == block(x.nbytes) + block(weight.nbytes)


def test_mismatched_weight_dtype_keeps_the_decomposition_as_on_a_card():
    # F.rms_norm decomposes on every device when the weight's dtype is not the input's (with a warning).
    x = torch.randn(ROWS, WIDTH, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    weight = torch.randn(WIDTH, device=DEV, requires_grad=True)
    with torch.profiler.profile() as prof:
        out = F.rms_norm(x, [WIDTH], weight, 1e-5)
    assert "aten::_fused_rms_norm" not in {e.name for e in prof.events()}
    assert torch.equal(out.cpu(), F.rms_norm(x.detach().cpu(), [WIDTH], weight.detach().cpu(), 1e-5))
