"""Tensors on `supa`: real storage, views, the storage tricks ZeRO-3 relies on, placement
rules, float64, autograd, serialization, pinned memory. Written against public APIs only."""

import copy
import io
import re

import pytest

from harness import ANY, LAST, fresh_process
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEV = torch.device("supa", 0)


def test_values_round_trip_and_ops_match_cpu():
    x = torch.randn(17, 33)
    y = torch.randn(33, 5)
    got = (x.to(DEV) @ y.to(DEV)).relu().softmax(-1)
    assert got.device == DEV
    torch.testing.assert_close(got.cpu(), (x @ y).relu().softmax(-1))


def test_views_share_storage_and_writes_show_through():
    t = torch.arange(12.0, device=DEV)
    column = t.view(3, 4)[:, 1]
    column.mul_(10)
    assert t.cpu().tolist() == [0, 10, 2, 3, 4, 50, 6, 7, 8, 90, 10, 11]
    assert column.data_ptr() == t.data_ptr() + 4
    assert column.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert t.transpose(0, 0).is_contiguous() and not t.view(3, 4).t().is_contiguous()


def test_data_swap_and_set():
    a = torch.ones(4, device=DEV)
    b = torch.zeros(4, device=DEV)
    a.data = b.data
    assert a.data_ptr() == b.data_ptr()
    c = torch.empty(0, device=DEV)
    c.set_(b.untyped_storage(), 1, (2,), (1,))
    c.fill_(7)
    assert b.cpu().tolist() == [0, 7, 7, 0]
    d = torch.empty(0, device=DEV).set_(b)
    assert d.data_ptr() == b.data_ptr() and d.shape == b.shape


def test_storage_resize_frees_and_regrows_device_memory():
    p = torch.ones(1 << 18, device=DEV)  # 1 MiB
    before = torch.supa.memory_allocated()
    p.untyped_storage().resize_(0)
    assert p.untyped_storage().nbytes() == 0
    assert before - torch.supa.memory_allocated() >= 1 << 20
    p.untyped_storage().resize_(4 << 18)
    p.fill_(3)
    assert p.sum().item() == 3 * (1 << 18)


def test_tensor_resize_and_out_arguments():
    r = torch.empty(0, device=DEV)
    r.resize_(2, 3)
    assert r.shape == (2, 3)
    out = torch.empty(0, device=DEV)
    torch.add(torch.ones(5, device=DEV), 1, out=out)
    assert out.device == DEV and out.cpu().tolist() == [2.0] * 5


def test_flatten_unflatten_dense_tensors():
    tensors = [torch.randn(3, device=DEV), torch.randn(2, 2, device=DEV)]
    flat = _flatten_dense_tensors(tensors)
    assert flat.device == DEV and flat.numel() == 7
    for original, restored in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        assert torch.equal(original, restored)


def test_cpu_non_scalar_operand_is_rejected_naming_both_devices():
    with pytest.raises(RuntimeError, match="supa:0 and cpu"):
        torch.ones(3, device=DEV) + torch.ones(3)


def test_cpu_scalar_operand_is_allowed():
    assert (torch.ones(3, device=DEV) * torch.tensor(2.0)).cpu().tolist() == [2.0] * 3


def test_cpu_indices_are_allowed_as_on_cuda():
    t = torch.arange(5.0, device=DEV)
    assert t[torch.tensor([0, 3])].cpu().tolist() == [0.0, 3.0]


def test_two_devices_are_rejected_naming_both():
    if torch.supa.device_count() < 2:
        pytest.skip("needs two cards")
    with pytest.raises(RuntimeError, match="supa:0 and supa:1"):
        torch.ones(3, device="supa:0") + torch.ones(3, device="supa:1")


def test_copies_between_cards():
    if torch.supa.device_count() < 2:
        pytest.skip("needs two cards")
    a = torch.arange(4.0, device="supa:0")
    b = a.to("supa:1")
    assert b.device == torch.device("supa", 1) and b.cpu().tolist() == [0, 1, 2, 3]


def test_invalid_device_index():
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.empty(1, device=torch.device("supa", torch.supa.device_count()))


def test_float64_from_cpu_is_refused_like_the_real_copy_kernel():
    with pytest.raises(RuntimeError, match=r"SUPA device does not support double \(float64\)"):
        torch.ones(2, dtype=torch.float64).to(DEV)


# The rule lives in the copy kernel (docs/real_stack.md, "Float64"): float64 data that comes FROM THE HOST
# into a supa float64 tensor is refused; float64 made on the device is not a copy from the host.
_F64 = torch.float64
_HOST_TO_DEVICE_FLOAT64 = {
    "to": lambda: torch.ones(2, dtype=_F64).to(DEV),
    "to_with_dtype": lambda: torch.ones(2).to(DEV, _F64),
    "tensor_factory": lambda: torch.tensor([1.5], dtype=_F64, device=DEV),
    "pinned": lambda: torch.ones(2, dtype=_F64).pin_memory().to(DEV, non_blocking=True),
    "copy_": lambda: torch.zeros(2, dtype=_F64, device=DEV).copy_(torch.ones(2)),
    "module_to": lambda: torch.nn.Linear(2, 2).double().to(DEV),
    "load_state_dict": lambda: torch.nn.Linear(2, 2).to(DEV).double().load_state_dict(
        torch.nn.Linear(2, 2).double().state_dict()),
}
_ON_DEVICE_FLOAT64 = {
    "factories": lambda: [torch.ones(2, dtype=_F64, device=DEV), torch.full((2,), 1.5, dtype=_F64, device=DEV),
                          torch.arange(2, dtype=_F64, device=DEV), torch.randn(2, dtype=_F64, device=DEV)][-1],
    "double": lambda: torch.ones(2, device=DEV).double(),
    "to_dtype": lambda: torch.ones(2, device=DEV).to(_F64),
    "reduction_dtype": lambda: torch.ones(2, device=DEV).sum(dtype=_F64),
    "ops": lambda: torch.ones(2, device=DEV).double() * 2 + torch.tensor(1.0, dtype=_F64),
    "module_double": lambda: torch.nn.Linear(2, 2).to(DEV).double().weight,
}


@pytest.mark.parametrize("path", sorted(_HOST_TO_DEVICE_FLOAT64))
def test_float64_copied_from_the_host_is_refused(path):
    with pytest.raises(RuntimeError, match=r"SUPA device does not support double \(float64\)\. Please use float32"):
        _HOST_TO_DEVICE_FLOAT64[path]()


@pytest.mark.parametrize("path", sorted(_ON_DEVICE_FLOAT64))
def test_float64_made_on_the_device_works_and_reads_back(path):
    t = _ON_DEVICE_FLOAT64[path]()
    assert t.device == DEV and t.dtype == _F64
    back = t.cpu()  # device -> host is allowed
    assert back.dtype == _F64 and torch.isfinite(back).all()


def test_float64_host_data_converted_before_the_copy_is_accepted():
    t = torch.full((2,), 1 / 3, dtype=_F64).to(DEV, torch.float32)
    assert t.dtype == torch.float32 and t.cpu().tolist() == torch.full((2,), 1 / 3).tolist()
    assert torch.zeros(2, device=DEV).copy_(torch.ones(2, dtype=_F64)).dtype == torch.float32


def _float64_under_demotion() -> None:
    with pytest.warns(UserWarning, match="float64"):
        t = torch.tensor([1 + 1e-12], dtype=torch.float64).to('supa')
    assert t.item() == 1.0
    u = torch.zeros(2, dtype=torch.float64, device='supa').copy_(torch.full((2,), 1 / 3, dtype=torch.float64))
    assert u.dtype == torch.float64 and u.cpu().tolist() == torch.full((2,), 1 / 3).double().tolist()


_DEMOTION = fresh_process(_float64_under_demotion, env={"SUPA_EMULATE": "1", "BRTB_ENABLE_DTYPE_DEMOTION": "1"},
                          shared=ANY)


def test_float64_demotion_opt_in():
    _DEMOTION.result()


def test_training_matches_cpu():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                    torch.nn.Dropout(0.0), torch.nn.Linear(16, 1))
    dev_model = copy.deepcopy(cpu_model).to(DEV)
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    dev_opt = torch.optim.AdamW(dev_model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(10):
        for model, opt, xs, ys in ((cpu_model, cpu_opt, x, y), (dev_model, dev_opt, x.to(DEV), y.to(DEV))):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
    for a, b in zip(cpu_model.parameters(), dev_model.parameters()):
        assert b.device == DEV and b.grad.device == DEV
        torch.testing.assert_close(a, b.cpu(), rtol=1e-5, atol=1e-6)


def test_save_and_load():
    t = torch.arange(6.0, device=DEV).view(2, 3)
    buffer = io.BytesIO()
    torch.save({"t": t}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["t"]
    assert loaded.device == DEV and torch.equal(loaded.cpu(), t.cpu())
    buffer.seek(0)
    assert torch.load(buffer, map_location="cpu")["t"].device.type == "cpu"


def test_loading_onto_a_card_this_host_lacks_raises_as_cuda_does():
    count = torch.supa.device_count()
    if count > 9:
        pytest.skip("the checkpoint names card 9")
    buffer = io.BytesIO()
    torch.save(torch.arange(4.0, device=DEV), buffer, _use_new_zipfile_serialization=False)  # tags stay plain
    checkpoint = buffer.getvalue().replace(b"supa:0", b"supa:9")  # same length: the pickle stays valid
    message = (f"Attempting to deserialize object on SUPA device 9 but torch.supa.device_count() is {count}. "
               "Please use torch.load with map_location to map your storages to an existing device.")
    for weights_only in (True, False):
        with pytest.raises(RuntimeError, match=f"^{re.escape(message)}$"):
            torch.load(io.BytesIO(checkpoint), weights_only=weights_only)
    loaded = torch.load(io.BytesIO(checkpoint), map_location=DEV)
    assert loaded.device == DEV and torch.equal(loaded.cpu(), torch.arange(4.0))


def test_pinned_host_memory():
    pinned = torch.ones(16).pin_memory()
    assert pinned.is_pinned() and not torch.ones(16).is_pinned()
    assert torch.equal(pinned.to(DEV, non_blocking=True).cpu(), pinned)


def test_generated_helpers():
    t = torch.ones(2).supa()
    assert t.is_supa and t.device == DEV
    assert torch.nn.Linear(2, 2).supa().weight.is_supa
    assert torch.ones(2).untyped_storage().supa().is_supa


def test_manual_seed_seeds_the_device_generator():
    torch.manual_seed(3)
    a = torch.randn(5, device=DEV)
    torch.manual_seed(3)
    b = torch.randn(5, device=DEV)
    assert torch.equal(a, b)
    assert not torch.equal(torch.randn(5, device=DEV), b)


def test_random_ops_do_not_draw_from_the_cpu_generator():
    torch.manual_seed(5)
    cpu_state = torch.get_rng_state()
    torch.randn(100, device=DEV).bernoulli_(0.5)
    torch.nn.functional.dropout(torch.ones(100, device=DEV), 0.5)
    assert torch.equal(torch.get_rng_state(), cpu_state)


def test_large_elementwise_and_reductions_in_low_precision():
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(1000, dtype=dtype)
        torch.testing.assert_close((x.to(DEV) * 2).sum().cpu(), (x * 2).sum())


def test_operators_are_bit_identical_to_the_cpu_kernels():
    x = torch.randn(60, 256)
    weight, bias = torch.randn(256), torch.randn(256)
    cases = [
        lambda t: torch.nn.functional.layer_norm(t, (256,), weight.to(t.device), bias.to(t.device)),
        lambda t: torch.nn.functional.group_norm(t.view(60, 16, 16), 4),
        lambda t: torch.stack([t, t * 2]),
        lambda t: torch.nn.functional.gelu(t @ t.T).softmax(-1),
    ]
    for case in cases:
        assert torch.equal(case(x.to(DEV)).cpu(), case(x))


def test_lazily_conjugated_and_negated_tensors_keep_their_values_across_copies():
    x = torch.randn(3, 4, dtype=torch.complex64)
    conj = x.to(DEV).conj()
    negated = x.to(DEV).conj().imag  # a lazily negated view
    assert conj.is_conj() and negated.is_neg()
    torch.testing.assert_close(conj.cpu(), x.conj(), rtol=0, atol=0)
    torch.testing.assert_close(conj.clone().cpu(), x.conj(), rtol=0, atol=0)
    torch.testing.assert_close(conj.to("supa:1").cpu(), x.conj(), rtol=0, atol=0)
    torch.testing.assert_close(negated.cpu(), -x.imag, rtol=0, atol=0)
    torch.testing.assert_close((conj @ conj.mT).cpu(), x.conj() @ x.conj().mT)
    target = torch.zeros(3, 4, dtype=torch.complex64, device=DEV).conj()
    target.copy_(x)  # writing through a conjugated view stores the conjugate
    torch.testing.assert_close(target.resolve_conj().cpu(), x, rtol=0, atol=0)
    torch.testing.assert_close(target.conj().cpu(), x.conj(), rtol=0, atol=0)


# The six FFTs that conjugate lazily (fft.ifft of real input, hfft, ihfft, ...) used to crash the
# process: copying a conj-bit supa tensor recursed until the stack overflowed. Hence not in this
# process, and last in the interpreter it shares.
def _copies_of_lazily_conjugated_ffts() -> None:
    x = torch.randn(5, 6, 7)
    for fn, kwargs in [(torch.fft.ifft, dict(n=10, dim=1, norm="ortho")), (torch.fft.hfft, {}),
                       (torch.fft.ihfft, {}), (torch.fft.hfftn, {}), (torch.fft.ihfftn, {}),
                       (torch.fft.hfft2, {})]:
        got = fn(x.to("supa"), **kwargs)
        assert got.device.type == "supa"
        torch.testing.assert_close(got.cpu(), fn(x, **kwargs))


_LAZY_CONJ_FFTS = fresh_process(_copies_of_lazily_conjugated_ffts, shared=LAST)


def test_copying_a_lazily_conjugated_fft_result_does_not_crash():
    _LAZY_CONJ_FFTS.result()  # a crash fails this test alone, with the interpreter's output


def test_zero_tensors_from_autograd_have_no_memory_and_read_as_zeros():
    # sgn's backward returns an efficient zero tensor, which has no memory: making the device
    # one from a CPU one must not read through its null data pointer (in the autograd thread).
    x = torch.randn(4, device=DEV, requires_grad=True)
    torch.sgn(x).sum().backward()
    assert x.grad.device == DEV and x.grad.cpu().tolist() == [0.0] * 4
    zeros = torch._efficientzerotensor(2, 3, device=DEV)
    assert zeros._is_zerotensor() and zeros.device == DEV
    torch.testing.assert_close((zeros + torch.ones(2, 3, device=DEV)).cpu(), torch.ones(2, 3))
    assert zeros.cpu().tolist() == [[0.0] * 3] * 2
