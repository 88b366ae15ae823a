"""Sparse tensors on supa: COO and compressed (CSR, CSC, BSR) layouts are built, converted and
computed with PyTorch's sparse CPU kernels, and give the CPU results on the supa device."""

import pytest
import torch

DEV = torch.device("supa", 0)


def _dense():
    torch.manual_seed(0)
    d = torch.randn(4, 6)
    return d * (torch.rand(4, 6) > 0.6)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr])
def test_conversions_keep_the_layout_and_the_device(layout):
    d = _dense()
    kwargs = {"blocksize": (2, 2)} if layout == torch.sparse_bsr else {}
    s = d.to(DEV).to_sparse(layout=layout, **kwargs)
    assert s.layout == layout and s.device == DEV
    parts = ([s._indices(), s._values()] if layout == torch.sparse_coo else
             [s.values(), s.crow_indices() if layout in (torch.sparse_csr, torch.sparse_bsr) else s.ccol_indices()])
    assert all(p.device == DEV for p in parts)
    torch.testing.assert_close(s.to_dense().cpu(), d, rtol=0, atol=0)
    torch.testing.assert_close(s.cpu().to_dense(), d, rtol=0, atol=0)
    back = d.to_sparse(layout=layout, **kwargs).to(DEV)
    assert back.layout == layout and back.device == DEV
    torch.testing.assert_close(back.to_dense().cpu(), d, rtol=0, atol=0)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr])
def test_sparse_tensors_live_on_a_card_other_than_the_current_one(layout):
    """As on CUDA, a sparse tensor can be moved to or built on any card, whichever is current."""
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    d = _dense()
    other = torch.device("supa", 1)
    with torch.supa.device(0):
        s = d.to_sparse(layout=layout)
        for moved in (s.to(other), s.to(DEV).to(other)):
            assert moved.device == other and moved.layout == layout
            torch.testing.assert_close(moved.to_dense().cpu(), d, rtol=0, atol=0)
        coo = d.to_sparse().coalesce()
        built = torch.sparse_coo_tensor(coo.indices().to(other), coo.values().to(other), coo.shape)
        assert built.device == other
        torch.testing.assert_close((built + built).to_dense().cpu(), d * 2, rtol=0, atol=0)


def test_coo_arithmetic_and_products_match_cpu():
    d = _dense()
    x = torch.randn(6, 3)
    s = d.to_sparse()
    sd = s.to(DEV)
    torch.testing.assert_close((sd + sd).to_dense().cpu(), (s + s).to_dense())
    torch.testing.assert_close((sd * 3).coalesce().values().cpu(), (s * 3).coalesce().values())
    torch.testing.assert_close(torch.sparse.mm(sd, x.to(DEV)).cpu(), torch.sparse.mm(s, x))
    torch.testing.assert_close(torch.sparse.sum(sd, dim=1).to_dense().cpu(), torch.sparse.sum(s, dim=1).to_dense())
    built = torch.sparse_coo_tensor(s._indices().to(DEV), s._values().to(DEV), s.shape)
    assert built.device == DEV
    torch.testing.assert_close(built.to_dense().cpu(), d)


def test_csr_products_match_cpu():
    d = _dense()
    a, b = torch.randn(4, 5), torch.randn(5, 6)
    csr = d.to_sparse_csr()
    dev = csr.to(DEV)
    x = torch.randn(6, 3)
    torch.testing.assert_close((dev @ x.to(DEV)).cpu(), csr @ x)
    got = torch.sparse.sampled_addmm(dev, a.to(DEV), b.to(DEV))
    assert got.layout == torch.sparse_csr and got.device == DEV
    torch.testing.assert_close(got.to_dense().cpu(), torch.sparse.sampled_addmm(csr, a, b).to_dense())
    mm_reduce = torch.sparse.mm(dev, x.to(DEV), "sum")
    torch.testing.assert_close(mm_reduce.cpu(), torch.sparse.mm(csr, x, "sum"))


def test_sparse_gradients_arrive_on_the_device():
    d = _dense()
    x = torch.randn(6, 3)
    results = []
    for device in ("cpu", DEV):
        s = d.to(device).to_sparse().requires_grad_()
        xd = x.to(device, copy=True).requires_grad_()
        torch.sparse.mm(s, xd).sum().backward()
        results.append((s.grad, xd.grad))
    (cpu_s, cpu_x), (dev_s, dev_x) = results
    assert dev_s.device == DEV and dev_s.layout == torch.sparse_coo and dev_x.device == DEV
    torch.testing.assert_close(dev_s.to_dense().cpu(), cpu_s.to_dense())
    torch.testing.assert_close(dev_x.cpu(), cpu_x)


def test_in_place_sparse_ops_update_the_supa_tensor():
    d = _dense()
    s = d.to(DEV).to_sparse()
    s.mul_(2)
    s.add_(d.to(DEV).to_sparse())
    assert s.device == DEV and s.layout == torch.sparse_coo
    torch.testing.assert_close(s.to_dense().cpu(), 3 * d)
    s.zero_()
    assert s._nnz() == 0 and s.to_dense().cpu().abs().sum() == 0


def test_a_device_option_or_a_copy_source_may_name_another_card():
    """As on CUDA: empty_like(x, device=), .to(card) and copy_ between cards of sparse tensors (what
    torch.cuda.comm.broadcast does with one) make the result on the named card; an op that mixes
    the operands of two cards is still refused."""
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    d = _dense()
    s = d.to_sparse().to(DEV).coalesce()
    other = torch.device("supa", 1)
    for made in (torch.empty_like(s, device=other), torch.zeros_like(s, device=other), s.to(other)):
        assert made.device == other and made.layout == torch.sparse_coo
        assert made._values().device == other and made._indices().device == other
    moved = s.to(other)
    torch.testing.assert_close(moved.to_dense().cpu(), d, rtol=0, atol=0)
    target = torch.empty_like(s, device=other)
    target.copy_(s)
    assert target.device == other and target._values().device == other
    torch.testing.assert_close(target.to_dense().cpu(), d, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, but found at least two "
                                           r"devices, supa:0 and supa:1! \(argument 'other' of aten::add.Tensor\)"):
        torch.add(s, moved)


def test_mixing_a_cpu_sparse_operand_is_rejected_as_on_cuda():
    s = _dense().to_sparse()
    with pytest.raises(RuntimeError, match="same device|supa"):
        torch.sparse.mm(s, torch.randn(6, 3, device=DEV))


@pytest.mark.parametrize("layout, op", [
    ("coo", lambda x: x.cumsum(0)), ("csr", lambda x: x.cumsum(0)), ("csr", torch.sort), ("coo", lambda x: x.view(9)),
], ids=["coo-cumsum", "csr-cumsum", "csr-sort", "coo-view"])
def test_what_the_cpu_cannot_do_on_a_sparse_layout_fails_as_on_the_cpu(layout, op):
    """No sparse kernel on the CPU: the same error (naming the sparse backend), never a crash."""
    errors = []
    for device in ("cpu", "supa"):
        dense = torch.eye(3, device=device)
        x = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
        with pytest.raises((NotImplementedError, RuntimeError)) as caught:
            op(x)
        errors.append(caught.value)
    assert type(errors[1]) is type(errors[0])
    assert str(errors[1]).splitlines()[0] == str(errors[0]).splitlines()[0]
    assert "Sparse" in str(errors[1]).splitlines()[0]
