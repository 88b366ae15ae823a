"""torch_supa.contrib.module, applied at activation as the real package applies it at import:
flex attention's device check accepts supa, F.normalize / F.one_hot take the fused `custom::`
operators under the real package's conditions, and BRTB_ENABLE_NATIVE_OP turns those off.
Values are held to the CPU (and flex attention to plain scaled-dot-product attention)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

DEVICE = "supa"


def _ops_run(fn) -> set:
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {event.name for event in prof.function_events}


@pytest.mark.parametrize("case, fused", [
    ({"dim": -1}, True),
    ({"dim": 1}, False),  # F.normalize's default dimension is not the fused kernel's
    ({"dim": -1, "p": 1.0}, False),
    ({"dim": -1, "eps": 0}, False),  # an int eps
    ({"dim": -1, "dtype": torch.float16}, False),
    ({"dim": -1, "transposed": True}, False),
])
def test_normalize_takes_the_fused_kernel_where_the_real_package_does(case, fused):
    case = dict(case)
    dtype, transposed = case.pop("dtype", torch.float32), case.pop("transposed", False)
    host = torch.randn(5, 6).to(dtype).t() if transposed else torch.randn(6, 5).to(dtype)
    device_input = host.to(DEVICE)  # keeps the transposed strides
    assert device_input.is_contiguous() != transposed
    result = {}
    ran = _ops_run(lambda: result.setdefault("out", F.normalize(device_input, **case)))
    assert ("custom::normalize_fused" in ran) == fused, sorted(ran)
    torch.testing.assert_close(result["out"].cpu(), F.normalize(host, **case))


def test_normalize_fused_gradients_match_the_cpu():
    host = torch.randn(4, 8, requires_grad=True)
    device_input = host.detach().to(DEVICE).requires_grad_()
    weights = torch.randn(4, 8)
    (F.normalize(host, dim=-1) * weights).sum().backward()
    (torch.normalize(device_input, dim=-1) * weights.to(DEVICE)).sum().backward()
    torch.testing.assert_close(device_input.grad.cpu(), host.grad)
    assert torch.normalize is F.normalize


def test_native_op_switch_keeps_pytorchs_operators(monkeypatch):
    labels = torch.tensor([3, 0, 1], device=DEVICE)
    unit = torch.randn(2, 4, device=DEVICE)
    assert "custom::one_hot_fused" in _ops_run(lambda: F.one_hot(labels, 4))
    for value in ("1", "TRUE", "on", "yes"):
        monkeypatch.setenv("BRTB_ENABLE_NATIVE_OP", value)
        ran = _ops_run(lambda: (F.one_hot(labels, 4), F.normalize(unit, dim=-1)))
        assert not {"custom::one_hot_fused", "custom::normalize_fused"} & ran, (value, sorted(ran))
    monkeypatch.setenv("BRTB_ENABLE_NATIVE_OP", "2")  # as the real package: not one of its "on" words
    assert "custom::normalize_fused" in _ops_run(lambda: F.normalize(unit, dim=-1))


@pytest.mark.parametrize("num_classes, fused", [(5, True), (-1, False)])
def test_one_hot(num_classes, fused):
    labels = torch.tensor([[4, 0], [2, 2]])
    result = {}
    ran = _ops_run(lambda: result.setdefault("out", F.one_hot(labels.to(DEVICE), num_classes)))
    assert ("custom::one_hot_fused" in ran) == fused
    assert result["out"].device.type == DEVICE
    assert torch.equal(result["out"].cpu(), F.one_hot(labels, num_classes))


def test_get_data_ptr():
    tensor = torch.empty(3, device=DEVICE)
    assert torch.ops.custom._get_data_ptr(tensor) == tensor.data_ptr()


def test_flex_attention_runs_on_supa_as_attention_does():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(2, 3, 128, 16) for _ in range(3))
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    on_card = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device=DEVICE)
    out = flex_attention(*on_card, block_mask=mask)
    expected = F.scaled_dot_product_attention(*reference, is_causal=True)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(expected)
    out.backward(grad.to(DEVICE))
    expected.backward(grad)
    for device_tensor, host_tensor in zip(on_card, reference):
        torch.testing.assert_close(device_tensor.grad.cpu(), host_tensor.grad, rtol=1e-4, atol=1e-5)


def test_flex_attention_refuses_other_devices_with_the_real_message():
    from torch.nn.attention import flex_attention as flex

    meta = torch.empty(1, 1, 16, 16, device="meta")
    with pytest.raises(ValueError, match="only supported on CUDA, CPU, or SUPA devices. Found input tensors on meta"):
        flex._validate_device(meta, meta, meta)
