"""The operators behind nn.SyncBatchNorm on supa tensors, against plain batch norm on the CPU.

SyncBatchNorm splits batch norm into per-rank statistics, a combination of all ranks'
statistics, and per-rank elementwise steps. Here two "ranks" are two halves of one batch in one
process: combined, they must give what F.batch_norm gives for the whole batch on the CPU (output,
running statistics, and the gradients autograd computes for it). The multi-process path runs in
torch's own SyncBatchNorm tests (test_torch_distributed.py).
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

EPS, MOMENTUM = 1e-5, 0.1
DEVICE = "supa"


def _halves(shape, memory_format=torch.contiguous_format):
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3 + 1
    grad = torch.randn(*shape)
    if len(shape) == 4:
        x, grad = x.contiguous(memory_format=memory_format), grad.contiguous(memory_format=memory_format)
    return x, grad, x.to(DEVICE).chunk(2), grad.to(DEVICE).chunk(2)


def _gather(parts, stats, running_mean, running_var, counts, op):
    """The group's statistics by `op`: with the ranks' counts, or with the one count all ranks share."""
    means, invstds = torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats])
    if op == "with_counts":
        return torch.batch_norm_gather_stats_with_counts(parts[0], means, invstds, running_mean, running_var,
                                                         MOMENTUM, EPS, counts)
    assert len(set(counts.tolist())) == 1
    return torch.batch_norm_gather_stats(parts[0], means, invstds, running_mean, running_var, MOMENTUM, EPS,
                                         int(counts[0]))


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (6, 4, 3, 5)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("gather", ["with_counts", "equal_counts"])
def test_two_halves_combine_to_whole_batch_norm(shape, affine, gather):
    channels = shape[1]
    x, grad, parts, grad_parts = _halves(shape)
    weight = torch.randn(channels) if affine else None
    bias = torch.randn(channels) if affine else None
    running_mean, running_var = torch.randn(channels), torch.rand(channels) + 0.5

    # Reference: the whole batch on the CPU.
    x_ref = x.clone().requires_grad_()
    w_ref = weight.clone().requires_grad_() if affine else None
    b_ref = bias.clone().requires_grad_() if affine else None
    rm_ref, rv_ref = running_mean.clone(), running_var.clone()
    out_ref = F.batch_norm(x_ref, rm_ref, rv_ref, w_ref, b_ref, training=True, momentum=MOMENTUM, eps=EPS)
    out_ref.backward(grad)

    w = weight.to(DEVICE) if affine else None
    b = bias.to(DEVICE) if affine else None
    rm, rv = running_mean.to(DEVICE), running_var.to(DEVICE)
    stats = [torch.batch_norm_stats(part, EPS) for part in parts]
    counts = torch.tensor([part.numel() // channels for part in parts], dtype=torch.float32, device=DEVICE)
    mean, invstd = _gather(parts, stats, rm, rv, counts, gather)
    outputs = [torch.batch_norm_elemt(part, w, b, mean, invstd, EPS) for part in parts]

    assert mean.device.type == DEVICE and outputs[0].device.type == DEVICE
    torch.testing.assert_close(torch.cat(outputs).cpu(), out_ref.detach())
    torch.testing.assert_close(rm.cpu(), rm_ref)
    torch.testing.assert_close(rv.cpu(), rv_ref)

    reduced = [torch.batch_norm_backward_reduce(g, part, mean, invstd, w, True, affine, affine)
               for g, part in zip(grad_parts, parts)]
    sum_dy = reduced[0][0] + reduced[1][0]
    sum_dy_xmu = reduced[0][1] + reduced[1][1]
    grad_inputs = [torch.batch_norm_backward_elemt(g, part, mean, invstd, w, sum_dy, sum_dy_xmu,
                                                   counts.to(torch.int32))
                   for g, part in zip(grad_parts, parts)]
    torch.testing.assert_close(torch.cat(grad_inputs).cpu(), x_ref.grad)
    if affine:
        torch.testing.assert_close((reduced[0][2] + reduced[1][2]).cpu(), w_ref.grad)
        torch.testing.assert_close((reduced[0][3] + reduced[1][3]).cpu(), b_ref.grad)
    else:
        assert all(r[2] is None or not r[2].numel() for r in reduced)


def test_gradients_not_asked_for_are_not_computed():
    _, grad, parts, grad_parts = _halves((4, 3))
    mean, invstd = torch.batch_norm_stats(parts[0], EPS)
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
        grad_parts[0], parts[0], mean, invstd, None, False, False, True)
    assert sum_dy is None or not sum_dy.numel()
    assert grad_weight is None or not grad_weight.numel()
    torch.testing.assert_close(grad_bias.cpu(), grad[:2].sum(0))


def test_channels_last_keeps_its_layout():
    x, _, parts, _ = _halves((4, 3, 2, 5), torch.channels_last)
    mean, invstd = torch.batch_norm_stats(parts[0], EPS)
    out = torch.batch_norm_elemt(parts[0], None, None, mean, invstd, EPS)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out.cpu(), F.batch_norm(x[:2], None, None, training=True, eps=EPS))


def test_reduced_precision_statistics_are_float32():
    x = torch.randn(8, 3, 4)
    half = x.to(torch.bfloat16).to(DEVICE)
    mean, invstd = torch.batch_norm_stats(half, EPS)
    assert mean.dtype == invstd.dtype == torch.float32
    wide = x.to(torch.bfloat16).float()
    torch.testing.assert_close(mean.cpu(), wide.mean((0, 2)))
    out = torch.batch_norm_elemt(half, None, None, mean, invstd, EPS)
    assert out.dtype == torch.bfloat16


def test_rank_that_counted_nothing_does_not_contribute():
    x = torch.randn(6, 3)
    mean, invstd = torch.batch_norm_stats(x.to(DEVICE), EPS)
    empty_mean, empty_invstd = torch.zeros(3, device=DEVICE), torch.full((3,), float("inf"), device=DEVICE)
    combined_mean, combined_invstd = torch.batch_norm_gather_stats_with_counts(
        x.to(DEVICE), torch.stack([mean, empty_mean]), torch.stack([invstd, empty_invstd]), None, None,
        MOMENTUM, EPS, torch.tensor([6.0, 0.0], device=DEVICE))
    torch.testing.assert_close(combined_mean.cpu(), x.mean(0))
    torch.testing.assert_close(combined_invstd.cpu(), (x.var(0, unbiased=False) + EPS).rsqrt())


def test_bad_input_says_what_was_expected():
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        torch.batch_norm_stats(torch.randn(5, device=DEVICE), EPS)
    means = torch.zeros(2, 3, device=DEVICE)
    with pytest.raises(RuntimeError, match=r"batch_norm_gather_stats: expected \(world, C\) means and invstds"):
        torch.batch_norm_gather_stats(means, means, torch.ones(2, 4, device=DEVICE), None, None, MOMENTUM, EPS, 5)
