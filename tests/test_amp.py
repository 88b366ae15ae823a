"""torch.supa.amp: autocast on supa, autocast state accessors, custom_fwd/bwd and GradScaler."""

import pytest

from harness import ANY, fresh_process
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")


def test_autocast_defaults_to_float16_on_supa():
    a = torch.randn(4, 4, device="supa")
    b = torch.randn(4, 4, device="supa")
    with torch.supa.amp.autocast():
        assert torch.supa.is_autocast_enabled()
        assert torch.supa.get_autocast_dtype() == torch.float16
        c = a @ b
    assert c.dtype == torch.float16
    assert not torch.supa.is_autocast_enabled()
    torch.testing.assert_close(c.float().cpu(), a.cpu() @ b.cpu(), atol=1e-2, rtol=1e-2)


def test_autocast_bfloat16_and_decorator_form():
    @torch.supa.amp.autocast(dtype=torch.bfloat16)
    def mm(x, y):
        return x @ y

    out = mm(torch.randn(2, 2, device="supa"), torch.randn(2, 2, device="supa"))
    assert out.dtype == torch.bfloat16


def test_torch_autocast_device_type_supa():
    with torch.autocast("supa", dtype=torch.bfloat16):
        out = torch.nn.functional.linear(torch.randn(2, 3, device="supa"), torch.randn(4, 3, device="supa"))
    assert out.dtype == torch.bfloat16


def test_autocast_state_setters_and_type_checks():
    prev_dtype = torch.supa.get_autocast_dtype()
    try:
        torch.supa.set_autocast_dtype(torch.bfloat16)
        assert torch.supa.get_autocast_dtype() == torch.bfloat16
        assert torch.supa.amp.get_autocast_gpu_dtype() == torch.bfloat16
        torch.supa.set_autocast_enabled(True)
        assert torch.supa.is_autocast_enabled()
    finally:
        torch.supa.set_autocast_enabled(False)
        torch.supa.set_autocast_dtype(prev_dtype)
    with pytest.raises(TypeError, match=r"enabled must be a bool \(got int\)"):
        torch.supa.set_autocast_enabled(1)
    with pytest.raises(TypeError, match=r"enabled must be a torch.dtype \(got str\)"):
        torch.supa.set_autocast_dtype("float16")


def test_amp_supported_dtypes():
    assert torch.supa.amp.get_amp_supported_dtype() == [torch.bfloat16, torch.float16, torch.float32]


def test_custom_fwd_casts_inputs_and_custom_bwd_runs():
    class Scale(torch.autograd.Function):
        @staticmethod
        @torch.supa.amp.custom_fwd(cast_inputs=torch.float32)
        def forward(ctx, x):
            ctx.seen_dtype = x.dtype
            return x * 2

        @staticmethod
        @torch.supa.amp.custom_bwd
        def backward(ctx, grad):
            return grad * 2

    x = torch.ones(3, device="supa", dtype=torch.float16, requires_grad=True)
    with torch.supa.amp.autocast():
        y = Scale.apply(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert torch.equal(x.grad.float().cpu(), torch.full((3,), 2.0))


def test_torch_amp_custom_fwd_casts_supa_inputs_to_cast_inputs():
    class Seen(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(cast_inputs=torch.float16, device_type="supa")
        def forward(ctx, x, y):
            ctx.dtypes = (x.dtype, y.dtype, torch.is_autocast_enabled("supa"))
            return x * 1

        @staticmethod
        @torch.amp.custom_bwd(device_type="supa")
        def backward(ctx, grad):
            return grad, None

    x = torch.ones(3, device="supa", requires_grad=True)
    with torch.autocast("supa"):
        y = Seen.apply(x, torch.ones(3, device="supa", dtype=torch.float64))
    assert y.dtype == torch.float16  # float64 stays float64; autocast is off inside forward
    assert y.grad_fn.dtypes == (torch.float16, torch.float64, False)
    y.sum().backward()
    assert x.grad.dtype == torch.float32


# ---- CUDA's autocast policies on supa (its op lists, as test_cuda.py's autocast tests use them) --

def _autocast_cases():
    from torch.testing._internal.autocast_test_lists import AutocastTestLists

    lists = AutocastTestLists(torch.device("supa"))
    for name, namespace, dtype in (("torch_fp32", torch, torch.float32), ("nn_fp32", torch._C._nn, torch.float32),
                                   ("torch_need_autocast_promote", torch, torch.float32)):
        for i, (op, args, *rest) in enumerate(getattr(lists, name)):
            yield pytest.param(namespace, op, args, rest[0] if rest else {}, dtype, id=f"{name}-{op}-{i}")


@pytest.mark.filterwarnings("ignore:Using torch.cross without specifying the dim arg")
@pytest.mark.parametrize("namespace, op, args, kwargs, dtype", _autocast_cases())
def test_autocast_runs_cudas_float32_ops_in_float32(namespace, op, args, kwargs, dtype):
    with torch.autocast("supa", dtype=torch.float16):
        out = getattr(namespace, op)(*args, **kwargs)
    assert (out if isinstance(out, torch.Tensor) else out[0]).dtype == dtype


@pytest.mark.parametrize("op", [lambda x: torch.softmax(x, 0), lambda x: x.cumsum(0), lambda x: x.sum(),
                                lambda x: x.prod(), lambda x: torch.norm(x), lambda x: torch.norm(x, 1, dim=0)],
                         ids=["softmax", "cumsum", "sum", "prod", "norm", "norm-dim"])
def test_autocast_reductions_of_float16_accumulate_in_float32(op):
    x = (torch.rand(64) + 0.5).half()
    with torch.autocast("supa", dtype=torch.float16):
        out = op(x.to("supa"))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), op(x.float()))


def test_binary_cross_entropy_is_banned_under_autocast_as_on_cuda():
    p, target = torch.rand(4, 4, device="supa"), torch.rand(4, 4, device="supa")
    with torch.autocast("supa"):
        with pytest.raises(RuntimeError, match=r"(?s)torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss "
                                               r"are unsafe to autocast.\n.*binary_cross_entropy_with_logits"):
            torch.nn.functional.binary_cross_entropy(p, target)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.BCELoss()(p, target)
        with_logits = torch.nn.functional.binary_cross_entropy_with_logits(p.half(), target)
    assert with_logits.dtype == torch.float32
    expected = torch.nn.functional.binary_cross_entropy(p.cpu(), target.cpu())  # outside autocast: allowed
    torch.testing.assert_close(torch.nn.functional.binary_cross_entropy(p, target).cpu(), expected)


def test_grad_scaler_training_step():
    model = torch.nn.Linear(4, 1).to("supa")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.supa.amp.GradScaler(init_scale=2.0**8)
    assert isinstance(scaler, torch.amp.GradScaler)
    before = model.weight.detach().clone()
    with torch.supa.amp.autocast():
        loss = model(torch.randn(8, 4, device="supa")).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**8
    assert not torch.equal(before.cpu(), model.weight.detach().cpu())


def test_grad_scaler_backs_off_on_inf():
    p = torch.nn.Parameter(torch.ones(2, device="supa"))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.supa.amp.GradScaler(init_scale=4.0)
    scaler.scale((p * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0
    assert torch.equal(p.detach().cpu(), torch.ones(2))


def test_grad_scaler_argument_checks():
    with pytest.raises(AssertionError, match="The growth factor must be > 1.0."):
        torch.supa.amp.GradScaler(growth_factor=1.0)
    with pytest.raises(AssertionError, match="The backoff factor must be < 1.0."):
        torch.supa.amp.GradScaler(backoff_factor=1.0)
    scaler = torch.supa.amp.GradScaler()
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale(3.0)


def test_grad_scaler_unscale_rules():
    p = torch.nn.Parameter(torch.ones(2, device="supa"))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.supa.amp.GradScaler()
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called on this optimizer"):
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element torch.supa.FloatTensor"):
        scaler.update(torch.ones(2, device="supa"))
    scaler.update(torch.full((1,), 8.0, device="supa"))
    assert scaler.get_scale() == 8.0


def test_grad_scaler_rejects_bf16_gradients():
    p = torch.nn.Parameter(torch.ones(2, device="supa", dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.supa.amp.GradScaler()
    scaler.scale(p.float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale BF16 gradients."):
        scaler.unscale_(opt)


def _grad_scaler_without_devices() -> None:
    with pytest.warns(UserWarning, match="SUPA is not available"):
        scaler = torch.supa.amp.GradScaler()
    assert not scaler.is_enabled()


_SCALER_WITHOUT_DEVICES = fresh_process(_grad_scaler_without_devices, env={"SUPA_VISIBLE_DEVICES": ""}, shared=ANY)


def test_grad_scaler_disables_itself_without_devices():
    _SCALER_WITHOUT_DEVICES.result()
