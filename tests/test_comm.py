"""torch.nn.parallel.comm (torch.cuda.comm) between SUPA cards: broadcast, scatter, gather.

Results are checked against the source tensors sliced or copied on the CPU; bad arguments raise
what PyTorch's CUDA implementation raises, worded for SUPA. The native entry points behind
torch.nn.parallel.comm come from torch_supa (installed on torch._C by transfer_to_supa).
"""

import pytest
import torch
from torch.nn.parallel import comm

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
if not hasattr(torch._C, "_scatter"):
    pytest.skip("torch.nn.parallel.comm reaches SUPA cards through transfer_to_supa", allow_module_level=True)


@pytest.fixture(autouse=True)
def two_cards():
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")


def card(index):
    return torch.device("supa", index)


def sparse(shape, nnz, dtype, seed, device="supa:0"):
    """An uncoalesced COO tensor (duplicate indices likely), as test_cuda's genSparseTensor makes."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randint(0, size, (nnz,), generator=generator) for size in shape])
    values = (torch.randn(nnz, generator=generator) * 10).to(dtype)
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True).to(device)


def assert_same_values(actual, expected):
    if actual.is_sparse:
        actual, expected = actual.to_dense(), expected.to_dense()
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0)


# ---- broadcast ---------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["cpu", "supa:0"])
def test_broadcast_copies_to_each_card_and_keeps_the_source_on_its_own(source):
    x = torch.randn(5, 5).to(source)
    results = comm.broadcast(x, (0, 1))
    assert [r.device for r in results] == [card(0), card(1)]
    for r in results:
        assert_same_values(r, x)
    assert (results[0] is x) == (source == "supa:0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float64])
def test_broadcast_of_a_sparse_tensor_copies_it_to_each_card(dtype):
    # float64 made on the card (as test_cuda_multigpu's genSparseTensor makes it) never crosses from the host.
    values = torch.randn(6, device=card(0)).to(dtype)
    indices = torch.tensor([[0, 1, 1, 0, 2, 1], [2, 0, 1, 2, 0, 0]], device=card(0))
    x = torch.sparse_coo_tensor(indices, values, (3, 3)).coalesce()
    results = comm.broadcast(x, (0, 1))
    assert results[0] is x
    assert results[1].device == card(1) and results[1].is_sparse and results[1].dtype == dtype
    assert results[1]._values().device == card(1)
    assert_same_values(results[1], x)


@pytest.mark.parametrize("source", ["cpu", "supa:0"])
def test_broadcast_into_out_tensors(source):
    x = torch.randn(5, 5).to(source)
    for outputs in ([torch.empty(5, 5, device=card(0)), torch.empty(5, 5, device=card(1))],
                    [x.to(card(0)), torch.empty(5, 5, device=card(1))]):
        results = comm.broadcast(x, out=outputs)
        assert all(r is o for r, o in zip(results, outputs))
        for r in results:
            assert_same_values(r, x)


def test_broadcast_argument_errors():
    x = torch.randn(5, 5, device=card(0))
    outputs = [torch.empty(5, 5, device=card(0)), torch.empty(5, 5, device=card(1))]
    with pytest.raises(RuntimeError, match="Exactly one of 'devices' and 'out'"):
        comm.broadcast(x, (0, 1), out=outputs)
    with pytest.raises(RuntimeError, match=r"Expected all output tensors to be SUPA tensors, but output tensor at "
                                           r"index 1 has device 'cpu'"):
        comm.broadcast(x, out=[outputs[0], x.cpu()])
    with pytest.raises(RuntimeError, match=r"Expected all output tensors to have same shape as the source tensor "
                                           r"\[5, 5\], but output tensor at index 1 has shape \[1, 5, 5\]"):
        comm.broadcast(x, out=[outputs[0], outputs[1].unsqueeze(0)])
    with pytest.raises(RuntimeError, match="Expected non-negative device index, but got -1"):
        comm.broadcast(x, (0, -1))


def test_broadcast_keeps_channels_last():
    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    for source in (x, x.to(card(0))):
        for r in comm.broadcast(source, (0, 1)):
            assert r.is_contiguous(memory_format=torch.channels_last) and not r.is_contiguous()
            assert_same_values(r, x)


def mixed_tensors():
    return [
        sparse((2, 3), 2, torch.float32, seed=1),
        torch.randn(5).long().to(card(0)),
        torch.randn(5).to(card(0)),
        sparse((2, 3), 10, torch.float32, seed=2),
        sparse((3, 3), 7, torch.int64, seed=3),
        torch.randn(5).long().to(card(0)),
        sparse((2, 7), 3, torch.int64, seed=4),
        torch.randn(10).int().to(card(0)),
        torch.randn(5).to(card(0)),
        torch.tensor([]).byte().to(card(0)),
    ]


def test_broadcast_coalesced_of_dense_and_sparse_tensors_matches_one_broadcast_each():
    tensors = mixed_tensors()
    copies = comm.broadcast_coalesced(tensors, (0, 1), buffer_size=100)  # several buffers
    assert len(copies) == 2
    assert all(original is kept for original, kept in zip(tensors, copies[0]))
    for original, copy in zip(tensors, copies[1]):
        assert copy.device == card(1) and copy.dtype == original.dtype and copy.layout == original.layout
        assert_same_values(copy, original)
    for copy in copies[1]:  # each copy has a version counter of its own
        before = [c._version for c in copies[1]]
        copy.zero_()
        after = [c._version for c in copies[1]]
        assert sum(a - b for a, b in zip(after, before)) == 1


def test_broadcast_coalesced_needs_its_tensors_on_the_first_device():
    with pytest.raises(RuntimeError, match=r"All tensors must be on devices\[0\]: 1"):
        comm.broadcast_coalesced([torch.randn(3, device=card(0))], (1, 0))


def test_reduce_add_coalesced_sums_dense_and_sparse_tensors():
    tensors = mixed_tensors()
    on_two_cards = [tensors, [t.to(card(1)) for t in tensors]]
    sums = comm.reduce_add_coalesced(on_two_cards, buffer_size=100)
    for total, original in zip(sums, tensors):
        assert total.device == card(0) and total.dtype == original.dtype and total.layout == original.layout
        assert_same_values(total, original * 2)


# ---- scatter -----------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["cpu", "supa:0"])
@pytest.mark.parametrize("shape, dim, chunk_sizes", [((4, 4), 0, None), ((4, 4), 1, None), ((4, 4), -2, None),
                                                    ((6, 4), 0, (2, 4)), ((5, 3), 0, None)])
def test_scatter_splits_along_dim_onto_the_cards(source, shape, dim, chunk_sizes):
    x = torch.randn(*shape).to(source)
    parts = comm.scatter(x, (0, 1), chunk_sizes, dim)
    expected = x.cpu().split(list(chunk_sizes), dim) if chunk_sizes else x.cpu().chunk(2, dim)
    assert [p.device for p in parts] == [card(0), card(1)]
    for part, reference in zip(parts, expected):
        assert_same_values(part, reference)
    if source == "supa:0":  # the chunk already on its card is a view of the source
        assert parts[0].data_ptr() == x.data_ptr()

    out = [torch.empty_like(p) for p in parts]
    results = comm.scatter(x, dim=dim, out=out)
    assert all(r is o for r, o in zip(results, out))
    for part, reference in zip(results, expected):
        assert_same_values(part, reference)


def test_scatter_argument_errors():
    x = torch.randn(6, 4)
    out = [torch.empty(2, 4, device=card(0)), torch.empty(4, 4, device=card(1))]
    with pytest.raises(RuntimeError, match=r"Expected devices and chunk_sizes to be of same length, but got "
                                           r"len\(devices\) = 3 and len\(chunk_sizes\) = 2"):
        comm.scatter(x, [0, 0, 0], chunk_sizes=(2, 4))
    with pytest.raises(RuntimeError, match="'devices' must not be specified"):
        comm.scatter(x, (0, 1), out=out)
    with pytest.raises(RuntimeError, match="'chunk_sizes' must not be specified"):
        comm.scatter(x, chunk_sizes=(2, 4), out=out)
    with pytest.raises(RuntimeError, match="Expected at least one device to scatter to"):
        comm.scatter(x, ())
    with pytest.raises(RuntimeError, match="Expected at least one output tensor to scatter to"):
        comm.scatter(x, out=[])
    with pytest.raises(RuntimeError, match="Expected all output tensors to be SUPA tensors, but output tensor at "
                                           "index 0 has device 'cpu'"):
        comm.scatter(x, out=[out[0].cpu(), out[1]])
    with pytest.raises(RuntimeError, match=r"Output tensor at index 0 has incorrect shape: \[1, 2, 4\]. Expected "
                                           r"same shape except for scatter dim 0 as the source tensor: \[6, 4\]"):
        comm.scatter(x, out=[out[0].unsqueeze(0), out[1]])
    with pytest.raises(RuntimeError, match="Total size for output tensors along scatter dim 0 does not match the "
                                           "source tensor size at dim 0. Expected 6, but got total size 5"):
        comm.scatter(x, out=[out[0][1:], out[1]])
    with pytest.raises(RuntimeError, match="split_with_sizes expects split_sizes to sum exactly to 6"):
        comm.scatter(x, (0, 1), chunk_sizes=(2, 3))
    with pytest.raises(RuntimeError, match="Expected non-negative device index, but got -1"):
        comm.scatter(x, (0, -1))


def test_scatter_streams_must_be_on_the_chunks_cards():
    x = torch.randn(4, 4)
    streams = [torch.supa.Stream(card(0)), torch.supa.Stream(card(1))]
    parts = comm.scatter(x, (0, 1), streams=streams)
    assert_same_values(torch.cat([p.cpu() for p in parts]), x)
    with pytest.raises(RuntimeError, match=r"Expected the device associated with the stream at index 1 \(was 0\) "
                                           r"to match the device supplied at that index \(expected 1\)"):
        comm.scatter(x, (0, 1), streams=[streams[0], streams[0]])


def test_scatter_and_gather_keep_channels_last():
    nhwc = torch.randn(10, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    parts = comm.scatter(nhwc, (0, 1), None, 0)
    for part in parts:
        assert not part.is_contiguous() and part.is_contiguous(memory_format=torch.channels_last)
    gathered = comm.gather(parts)
    assert gathered.is_contiguous(memory_format=torch.channels_last)
    assert_same_values(gathered, nhwc)
    mixed = comm.gather([parts[0], parts[1].contiguous()])  # formats differ: contiguous
    assert mixed.is_contiguous()


# ---- gather ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_concatenates_on_the_destination(dim):
    x, y = torch.randn(2, 5, device=card(0)), torch.randn(2, 5, device=card(1))
    expected = torch.cat([x.cpu(), y.cpu()], dim)
    with torch.supa.device(1):
        for destination, device in ((None, card(1)), (card(0), card(0)), ("cpu", torch.device("cpu"))):
            result = comm.gather((x, y), dim, destination=destination)
            assert result.device == device
            assert_same_values(result, expected)
            out = torch.empty(expected.shape, device=device)
            assert comm.gather((x, y), dim, out=out) is out
            assert_same_values(out, expected)


def test_gather_argument_errors():
    x, y = torch.randn(2, 5, device=card(0)), torch.randn(2, 5, device=card(1))
    with pytest.raises(RuntimeError, match="'destination' must not be specified"):
        comm.gather((x, y), 0, destination="cpu", out=torch.empty(4, 5))
    with pytest.raises(RuntimeError, match="Expected at least one tensor to gather from"):
        comm.gather(())
    with pytest.raises(RuntimeError, match="Expected at least one tensor to gather from"):
        comm.gather((), out=torch.empty(4, 5))
    with pytest.raises(RuntimeError, match="Expected all input tensors to be SUPA tensors, but tensor at index 0 "
                                           "has device cpu"):
        comm.gather((x.cpu(), y))
    with pytest.raises(RuntimeError, match="Expected all input tensors to have the same number of dimensions, but "
                                           r"tensor at index 1 has 3 dimensions, \(expected 2\)"):
        comm.gather((x, y.unsqueeze(0)))
    with pytest.raises(RuntimeError, match=r"Input tensor at index 1 has invalid shape \[2, 4\], but expected "
                                           r"\[2, 5\]"):
        comm.gather((x, y[:, 1:]), dim=0)
    with pytest.raises(RuntimeError, match=r"Expected out tensor to have shape \[4, 5\], but got \[4, 4\]"):
        comm.gather((x, y), out=torch.empty(4, 4, device=card(0)))
