"""torch.supa.bccl: single-process collectives over the cards of one process (torch.cuda.nccl's API).

Results are checked against plain PyTorch on CPU copies of the inputs; bad arguments raise what
torch.cuda.nccl raises. Also: torch.nn.DataParallel over two cards, whose gradients (summed
from the replicas by bccl.reduce) equal those of one card, without a warning.
"""

import warnings

import pytest
import torch

bccl = torch.supa.bccl
SUM, PROD, MAX, MIN, AVG = range(5)  # ncclRedOp_t codes
OPS = {"sum": SUM, "prod": PROD, "max": MAX, "min": MIN, "avg": AVG}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8]


def cards(count):
    if torch.supa.device_count() < count:
        pytest.skip(f"needs {count} SUPA cards")
    return [torch.device("supa", index) for index in range(count)]


@pytest.fixture(autouse=True)
def no_warnings():
    """Valid calls warn about nothing (before BCCL existed here, is_available warned on every call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def host_inputs(count, numel, dtype, op, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        values = torch.randn(count, numel, generator=generator)
        if op == PROD:
            values = 0.5 + values.abs()  # a product of moderate factors stays in range
        return values.to(dtype)
    # 8 cards of int8 stay in range (NCCL's integer sums wrap like the dtype; PyTorch's sum widens)
    low, high = (1, 3) if op == PROD else (-15 if dtype != torch.uint8 else 0, 16)
    return torch.randint(low, high, (count, numel), generator=generator).to(dtype)


def expected(rows, op):
    """What NCCL computes, by plain PyTorch on the CPU (floating types accumulated in float32)."""
    wide = rows.float() if rows.dtype.is_floating_point else rows
    if op == SUM:
        result = wide.sum(0)
    elif op == PROD:
        result = wide.prod(0)
    elif op == MAX:
        result = wide.amax(0)
    elif op == MIN:
        result = wide.amin(0)
    elif rows.dtype.is_floating_point:
        result = wide.mean(0)
    else:
        result = torch.div(wide.sum(0), len(rows), rounding_mode="trunc")
    return result.to(rows.dtype)


def tolerance(dtype, count):
    if dtype in (torch.float16, torch.bfloat16):  # rounded at every step of the rank-order sum
        return dict(rtol=count * (1e-2 if dtype == torch.bfloat16 else 2e-3), atol=count * 1e-2)
    return dict(rtol=1e-5, atol=1e-5) if dtype.is_floating_point else dict(rtol=0, atol=0)


def on_cards(rows, devices):
    return [row.to(device) if row.dtype != torch.float64 else row.float().to(device).double()
            for row, device in zip(rows, devices)]


# ---- version, availability, communicators -------------------------------------------------------

def test_version_is_a_tuple_past_nccl_2_10():
    version = bccl.version()
    assert isinstance(version, tuple) and len(version) in (3, 4)
    assert all(isinstance(part, int) for part in version[:3])
    assert version >= (2, 10)  # DistributedDataParallel and DeepSpeed gate AVG / bf16 on this
    if torch.cuda.is_available() and torch.cuda.nccl.all_reduce is bccl.all_reduce:  # transfer_to_supa
        assert torch.cuda.nccl.version() == version


@pytest.mark.emulation_only
def test_emulated_version_is_the_documented_one():
    assert bccl.version() == (2, 18, 1)


def test_is_available_for_dense_contiguous_tensors_on_distinct_cards():
    zero, one = cards(2)
    assert bccl.is_available([torch.ones(4, device=zero), torch.ones(4, device=one)]) is True
    assert bccl.is_available([torch.ones(4, device=zero), torch.ones(4, device=zero)]) is False
    assert bccl.is_available([torch.ones(4), torch.ones(4, device=one)]) is False
    assert bccl.is_available([torch.ones(4, 4, device=zero).t(), torch.ones(16, device=one)]) is False
    assert bccl.is_available([torch.ones(4, device=zero).to_sparse()]) is False


def test_unique_id_and_init_rank():
    uid = bccl.unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128 and uid != bccl.unique_id()
    with torch.supa.device(cards(2)[1]):
        comm = bccl.init_rank(2, uid, 1)
    assert "rank 1 of 2" in repr(comm)
    with pytest.raises(RuntimeError, match="invalid argument"):
        bccl.init_rank(2, uid, 2)
    with pytest.raises(RuntimeError, match="expected 128 bytes, got 3"):
        bccl.init_rank(2, b"abc", 0)
    with pytest.raises(TypeError):
        bccl.init_rank("2", uid, 0)


def communicators(devices, ranks=None):
    uid = bccl.unique_id()
    comms = []
    for device, rank in zip(devices, ranks or range(len(devices))):
        with torch.supa.device(device):
            comms.append(bccl.init_rank(len(devices), uid, rank))
    return comms


# ---- results against plain PyTorch -------------------------------------------------------------

@pytest.mark.parametrize("count", [2, 8])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_in_place(count, op, dtype):
    devices = cards(count)
    rows = host_inputs(count, 1000, dtype, OPS[op])
    tensors = on_cards(rows, devices)
    bccl.all_reduce(tensors, op=OPS[op])
    for tensor, device in zip(tensors, devices):
        assert tensor.device == device
        torch.testing.assert_close(tensor.cpu(), expected(rows, OPS[op]), **tolerance(dtype, count))


@pytest.mark.parametrize("op", OPS)
def test_all_reduce_out_of_place_leaves_the_inputs(op):
    devices = cards(4)
    rows = host_inputs(4, 777, torch.float32, OPS[op])
    inputs = on_cards(rows, devices)
    outputs = [torch.full((777,), -1.0, device=device) for device in devices]
    bccl.all_reduce(inputs, outputs, op=OPS[op])
    for output in outputs:
        torch.testing.assert_close(output.cpu(), expected(rows, OPS[op]))
    for row, tensor in zip(rows, inputs):
        assert torch.equal(tensor.cpu(), row)


def test_all_reduce_of_tensors_of_different_shapes_but_one_count():
    zero, one = cards(2)
    a, b = torch.arange(6.0, device=zero).view(2, 3), torch.arange(6.0, device=one).view(3, 2)
    bccl.all_reduce([a, b])
    assert torch.equal(a.cpu().flatten(), 2 * torch.arange(6.0))
    assert torch.equal(b.cpu().flatten(), 2 * torch.arange(6.0))


def test_bool_max_and_min_are_or_and_and():
    zero, one = cards(2)
    a = torch.tensor([True, True, False, False], device=zero)
    b = torch.tensor([True, False, True, False], device=one)
    high, low = [torch.empty(4, dtype=torch.bool, device=d) for d in (zero, one)], [a.clone(), b.clone()]
    bccl.all_reduce([a, b], high, op=MAX)
    bccl.all_reduce(low, op=MIN)
    assert high[1].cpu().tolist() == [True, True, True, False]
    assert low[0].cpu().tolist() == [True, False, False, False]


@pytest.mark.parametrize("root", [0, 2])
@pytest.mark.parametrize("op", OPS)
def test_reduce_to_the_root(root, op):
    devices = cards(3)
    rows = host_inputs(3, 513, torch.float32, OPS[op])
    inputs = on_cards(rows, devices)
    output = torch.empty(513, device=devices[root])
    bccl.reduce(inputs, output, root=root, op=OPS[op])
    torch.testing.assert_close(output.cpu(), expected(rows, OPS[op]))
    for row, tensor in zip(rows, inputs):
        assert torch.equal(tensor.cpu(), row)
    bccl.reduce(inputs, root=root, op=OPS[op])  # default output: the root's input, in place
    torch.testing.assert_close(inputs[root].cpu(), expected(rows, OPS[op]))
    assert all(torch.equal(t.cpu(), row) for i, (t, row) in enumerate(zip(inputs, rows)) if i != root)


def test_reduce_with_the_deprecated_output_list_warns():
    zero, one = cards(2)
    inputs = [torch.ones(3, device=zero), torch.ones(3, device=one)]
    outputs = [torch.empty(3, device=zero), torch.empty(3, device=one)]
    with pytest.warns(FutureWarning, match="deprecated"):
        bccl.reduce(inputs, outputs=outputs, root=1)
    assert outputs[1].cpu().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="not both"):
        bccl.reduce(inputs, outputs[0], outputs=outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_broadcast_from_every_root(dtype):
    devices = cards(4)
    for root in range(4):
        rows = (torch.randn(4, 300) > 0).to(dtype) if dtype == torch.bool else host_inputs(4, 300, dtype, SUM, root)
        tensors = on_cards(rows, devices)
        bccl.broadcast(tensors, root=root)
        assert all(torch.equal(t.cpu(), rows[root]) and t.device == d for t, d in zip(tensors, devices))


@pytest.mark.parametrize("count", [2, 8])
def test_all_gather_concatenates_in_rank_order(count):
    devices = cards(count)
    rows = host_inputs(count, 100, torch.float16, SUM)
    outputs = [torch.empty(count * 100, dtype=torch.float16, device=d) for d in devices]
    bccl.all_gather(on_cards(rows, devices), outputs)
    assert all(torch.equal(output.cpu(), rows.flatten()) for output in outputs)


def test_all_gather_in_place_from_each_ranks_chunk():
    devices = cards(3)
    outputs = [torch.zeros(3, 5, device=d) for d in devices]
    inputs = [output[rank] for rank, output in enumerate(outputs)]
    for rank, tensor in enumerate(inputs):
        tensor.fill_(rank + 1)
    bccl.all_gather(inputs, outputs)
    for output in outputs:
        assert torch.equal(output.cpu(), torch.tensor([1.0, 2.0, 3.0]).repeat_interleave(5).view(3, 5))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
def test_reduce_scatter_gives_each_rank_its_chunk(op, dtype):
    devices = cards(4)
    rows = host_inputs(4, 4 * 64, dtype, OPS[op])
    outputs = [torch.empty(64, dtype=dtype, device=d) for d in devices]
    bccl.reduce_scatter(on_cards(rows, devices), outputs, op=OPS[op])
    whole = expected(rows, OPS[op])
    for rank, output in enumerate(outputs):
        torch.testing.assert_close(output.cpu(), whole[rank * 64:(rank + 1) * 64], **tolerance(dtype, 4))


def test_reduce_scatter_in_place_into_a_chunk_of_the_input():
    devices = cards(2)
    rows = host_inputs(2, 8, torch.float32, SUM)
    inputs = on_cards(rows, devices)
    outputs = [inputs[0][4:], inputs[1][4:]]  # rank 0 writes over its input's chunk for rank 1
    bccl.reduce_scatter(inputs, outputs)
    whole = rows.sum(0)
    torch.testing.assert_close(outputs[0].cpu(), whole[:4])
    torch.testing.assert_close(outputs[1].cpu(), whole[4:])


def test_collectives_allocate_nothing_on_the_cards():
    devices = cards(2)
    tensors = [torch.ones(1 << 16, device=d) for d in devices]
    outputs = [torch.empty(1 << 17, device=d) for d in devices]
    before = [torch.supa.memory_allocated(d) for d in devices]
    bccl.all_reduce(tensors)
    bccl.all_gather(tensors, outputs)
    bccl.reduce_scatter(outputs, tensors)
    assert [torch.supa.memory_allocated(d) for d in devices] == before


# ---- streams and communicators ------------------------------------------------------------------

def test_streams_and_communicators_as_the_real_api_takes_them():
    devices = cards(3)
    rows = host_inputs(3, 50, torch.float32, SUM)
    tensors = on_cards(rows, devices)
    streams = [torch.supa.Stream(device=d) for d in devices]
    streams[1] = None  # None: the card's current stream
    bccl.all_reduce(tensors, streams=streams, comms=communicators(devices))
    assert all(torch.allclose(t.cpu(), rows.sum(0)) for t in tensors)


def test_communicator_ranks_order_the_gather():
    devices = cards(3)
    ranks = [2, 0, 1]  # input i is rank ranks[i]
    inputs = [torch.full((2,), float(i), device=d) for i, d in enumerate(devices)]
    outputs = [torch.empty(6, device=d) for d in devices]
    bccl.all_gather(inputs, outputs, comms=communicators(devices, ranks))
    assert outputs[0].cpu().tolist() == [1.0, 1.0, 2.0, 2.0, 0.0, 0.0]
    bccl.broadcast(inputs, root=0, comms=communicators(devices, ranks))  # rank 0 is inputs[1]
    assert all(t.cpu().tolist() == [1.0, 1.0] for t in inputs)


def test_bad_streams_and_communicators():
    zero, one = cards(2)
    tensors = [torch.ones(2, device=zero), torch.ones(2, device=one)]
    with pytest.raises(RuntimeError, match="number of streams"):
        bccl.all_reduce(tensors, streams=[None])
    with pytest.raises(TypeError, match="streams"):
        bccl.all_reduce(tensors, streams=["stream", None])
    with pytest.raises(RuntimeError, match="stream 1 is on supa:0"):
        bccl.all_reduce(tensors, streams=[None, torch.supa.current_stream(zero)])
    with pytest.raises(RuntimeError, match="number of communicators"):
        bccl.all_reduce(tensors, comms=communicators([zero]))
    with pytest.raises(ValueError, match="not a communicator"):
        bccl.all_reduce(tensors, comms=[object(), object()])
    with pytest.raises(TypeError, match="not a sequence"):
        bccl.all_reduce(tensors, comms=3)
    with pytest.raises(RuntimeError, match="different init_rank ids"):
        bccl.all_reduce(tensors, comms=[communicators([zero, one])[0], communicators([zero, one])[1]])
    with pytest.raises(RuntimeError, match="every rank, once"):
        bccl.all_reduce(tensors, comms=communicators([zero, one], [0, 0]))
    with pytest.raises(RuntimeError, match="made on supa:1"):
        bccl.all_reduce(tensors, comms=communicators([one, zero]))
    assert all(t.cpu().tolist() == [1.0, 1.0] for t in tensors)  # nothing ran


# ---- bad input: torch.cuda.nccl's errors ---------------------------------------------------------

def test_bad_tensors_raise_what_torch_cuda_nccl_raises():
    zero, one = cards(2)
    a, b = torch.ones(4, device=zero), torch.ones(4, device=one)
    cases = [
        (TypeError, "collection of tensors", lambda: bccl.all_reduce(a)),
        (TypeError, "expected Tensor at 1", lambda: bccl.all_reduce([a, 1.0])),
        (RuntimeError, "can't be empty", lambda: bccl.all_reduce([])),
        (RuntimeError, "unique devices", lambda: bccl.all_reduce([a, torch.ones(4, device=zero)])),
        (RuntimeError, "same number of elements", lambda: bccl.all_reduce([a, torch.ones(5, device=one)])),
        (RuntimeError, "same dtype", lambda: bccl.all_reduce([a, torch.ones(4, dtype=torch.half, device=one)])),
        (RuntimeError, "contiguous", lambda: bccl.all_reduce([torch.ones(2, 2, device=zero).t(),
                                                              torch.ones(4, device=one)])),
        (RuntimeError, "dense supa tensors", lambda: bccl.all_reduce([a, torch.ones(4)])),
        (RuntimeError, "same length", lambda: bccl.all_reduce([a, b], [a])),
        (RuntimeError, "same device", lambda: bccl.all_reduce([a, b], [b, a])),
        (RuntimeError, "Unconvertible BCCL type torch.int16",
         lambda: bccl.all_reduce([torch.ones(4, dtype=torch.int16, device=d) for d in (zero, one)])),
        (RuntimeError, "not a reduction", lambda: bccl.all_reduce([a, b], op=7)),
        (TypeError, "'op' must be an integer", lambda: bccl.all_reduce([a, b], op="sum")),
        (RuntimeError, "invalid root", lambda: bccl.broadcast([a, b], root=2)),
        (RuntimeError, "invalid root", lambda: bccl.broadcast([a, b], root=-1)),
        (IndexError, "index out of range", lambda: bccl.reduce([a, b], root=2)),
        (RuntimeError, "invalid root", lambda: bccl.reduce([a, b], a, root=2)),
        (RuntimeError, "output must be of size", lambda: bccl.all_gather([a, b], [torch.empty(4, device=zero),
                                                                                  torch.empty(8, device=one)])),
        (RuntimeError, "output must be of size", lambda: bccl.reduce_scatter([a, b], [a, b])),
        (RuntimeError, "same device", lambda: bccl.reduce([a, b], torch.empty(4, device=zero), root=1)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    assert a.cpu().tolist() == b.cpu().tolist() == [1.0] * 4  # nothing ran


# ---- torch.nn.DataParallel ---------------------------------------------------------------------

def _train(model, steps, device_ids=None, device="supa:0"):
    net = torch.nn.DataParallel(model, device_ids=device_ids) if device_ids else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(steps):
        x, y = torch.randn(12, 6, generator=generator), torch.randn(12, 3, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x.to(device)), y.to(device)).backward()
        grads.append([p.grad.cpu() for p in model.parameters()])
        optimizer.step()
    return grads, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("names", ["cuda", "supa"])
def test_data_parallel_over_two_cards_trains_as_one_card(names):
    if not torch.cuda.is_available() and names == "cuda":
        pytest.skip("CUDA names need transfer_to_supa")
    cards(2)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 3))
    reference.eval()  # BatchNorm's batch statistics differ per replica; its running buffers still broadcast
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3)).eval()
    model.load_state_dict(reference.state_dict())
    expected_grads, expected_params = _train(reference.to(f"{names}:0"), 3, device=f"{names}:0")
    grads, params = _train(model.to(f"{names}:0"), 3, device_ids=[0, 1], device=f"{names}:0")
    for step_grads, step_expected in zip(grads, expected_grads):
        for grad, reference_grad in zip(step_grads, step_expected):
            torch.testing.assert_close(grad, reference_grad, rtol=1e-5, atol=1e-6)
    for param, reference_param in zip(params, expected_params):
        torch.testing.assert_close(param, reference_param, rtol=1e-5, atol=1e-6)


def test_data_parallel_sums_the_replicas_gradients_with_bccl(monkeypatch):
    zero, _ = cards(2)
    if torch.nn.parallel.comm.nccl.reduce is not bccl.reduce:
        pytest.skip("torch.cuda.nccl is torch.supa.bccl under transfer_to_supa only")
    calls = []
    reduce = bccl.reduce
    monkeypatch.setattr(torch.nn.parallel.comm.nccl, "reduce",
                        lambda inputs, *args, **kwargs: calls.append(len(inputs)) or reduce(inputs, *args, **kwargs))
    model = torch.nn.Linear(4, 2).to(zero)
    torch.nn.DataParallel(model, device_ids=[0, 1])(torch.randn(6, 4, device=zero)).sum().backward()
    assert calls == [2]  # one coalesced buffer of both parameters' gradients, from two replicas


def test_data_parallel_replicas_are_broadcast_by_bccl_in_one_buffer(monkeypatch):
    cards(2)
    if torch.nn.parallel.comm.nccl.reduce is not bccl.reduce:
        pytest.skip("DataParallel reaches torch.supa.bccl through transfer_to_supa only")
    calls = []
    broadcast = bccl.broadcast
    monkeypatch.setattr(bccl, "broadcast", lambda tensors, *args, **kwargs:
                        calls.append([t.numel() for t in tensors]) or broadcast(tensors, *args, **kwargs))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to("supa:0")
    replicas = torch.nn.parallel.replicate(model, [0, 1])
    assert calls == [[23, 23]]  # the four parameters flattened into one buffer, sent to both cards
    for original, copy in zip(model.parameters(), replicas[1].parameters()):
        assert copy.device == torch.device("supa", 1) and torch.equal(copy.cpu(), original.cpu())
