"""The bccl backend: every collective DeepSpeed uses, on supa tensors, across real processes.

Each test body runs in every rank (ranks.distributed_test: rank r on supa:r, a bccl default group)
and asserts there; expected values are computed independently on the CPU, from inputs every rank
can rebuild. Two ranks unless a test says otherwise.

The collective semantics hold on real cards too (with a real torch_supa installed the emulator
stands down and SUPA_EMULATE=1 changes nothing), so only the checks of the emulator's own
behaviour (its error texts, its group object, the cross-rank signature check and the dead/stalled
peer detection it builds on) are marked `emulation_only`.
"""

import datetime
import time

import pytest
from ranks import distributed_test, exit_rank, rank_store
import torch
import torch.distributed as dist

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

R = dist.ReduceOp
DTYPES = ("float32", "float16", "bfloat16", "int32", "int64")
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
_INPUTS = (torch.tensor([1, 3, -5, 7, 2]), torch.tensor([2, 3, -6, 1, 2]))  # rank r's is _INPUTS[r]


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """`actual` stayed on this rank's card and holds exactly `expected`."""
    assert actual.device == torch.device("supa", dist.get_rank()), f"result moved to {actual.device}"
    assert torch.equal(actual.cpu(), expected), f"{actual.cpu()} != {expected}"


def _reduced(dtype: torch.dtype, op: str) -> torch.Tensor:
    """`op` over both ranks' _INPUTS, in `dtype` (AVG of integers truncates, as NCCL's)."""
    first, second = _INPUTS
    if op == "AVG":
        total = (first + second).to(dtype)
        return total / 2 if dtype.is_floating_point else torch.div(total, 2, rounding_mode="trunc")
    folds = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum}
    return folds[op](first, second).to(dtype)


def _raises_mismatch(call, *details, what: str = "the call") -> None:
    """`call` fails with the cross-rank signature check's error, naming `details`."""
    try:
        call()
    except RuntimeError as error:
        assert "mismatch" in str(error) and all(detail in str(error) for detail in details), error
    else:
        raise AssertionError(f"{what} did not fail")


def _group_still_works() -> None:
    z = torch.ones(2, device="supa")
    dist.all_reduce(z)
    _same(z, torch.full((2,), 2.0))


# ------------------------------------------------------------------------------------------------
# The group
# ------------------------------------------------------------------------------------------------
@pytest.mark.emulation_only
@distributed_test()
def test_default_group_is_a_bccl_group(rank, world):
    assert type(dist.group.WORLD).__name__ == "ProcessGroupBCCL"
    assert dist.get_backend() == "bccl"


@pytest.mark.emulation_only
@distributed_test()
def test_default_timeout_is_nccls_ten_minutes(rank, world):
    assert dist.group.WORLD.options._timeout == datetime.timedelta(minutes=10)


# ------------------------------------------------------------------------------------------------
# Reductions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@distributed_test()
def test_all_reduce_dtypes_and_ops(rank, world, dtype, op):
    dtype = getattr(torch, dtype)
    x = _INPUTS[rank].to(dtype).to("supa")
    dist.all_reduce(x, op=getattr(R, op))
    _same(x, _reduced(dtype, op))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@distributed_test()
def test_reduce_scatter_tensor_dtypes_and_ops(rank, world, dtype, op):
    # bccl reduces this one itself after an all-to-all: each rank gets 2 of the 4 elements.
    dtype = getattr(torch, dtype)
    out = torch.empty(2, 1, dtype=dtype, device="supa").t()  # non-contiguous: staged and written back
    dist.reduce_scatter_tensor(out, _INPUTS[rank][:4].to(dtype).to("supa"), op=getattr(R, op))
    _same(out, _reduced(dtype, op)[2 * rank:2 * rank + 2].view(1, 2))


@distributed_test()
def test_all_reduce_matches_gloo_bit_for_bit(rank, world):
    # bccl reduces all_reduce itself after an exchange; with 2 ranks its bits must be gloo's.
    gloo = dist.new_group(backend="gloo")
    generator = torch.Generator().manual_seed(1234 + rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            # 40,000 float32 elements: 160 KB; 2,500,000 (10 MB) are past the exchange: gloo's ring.
            for numel in (1000, 40_000) + ((2_500_000,) if dtype == torch.float32 and op == "SUM" else ()):
                data = torch.randn(numel, generator=generator).to(dtype)
                on_device, on_host = data.to("supa"), data.clone()
                dist.all_reduce(on_device, op=getattr(R, op))
                dist.all_reduce(on_host, op=getattr(R, op), group=gloo)
                assert torch.equal(on_device.cpu().view(torch.int8), on_host.view(torch.int8)), (dtype, op, numel)
    dist.destroy_process_group(gloo)


@pytest.mark.parametrize("op", ["MIN", "MAX"])
@distributed_test()
def test_all_reduce_of_signed_zeros_is_the_same_on_every_rank(rank, world, op):
    # MIN/MAX of -0.0 and 0.0 depend on operand order (gloo's pick varies with the element's
    # position in its ring chunks); bccl's must at least be the same on every rank.
    zeros = torch.full((1000,), -0.0 if rank == 0 else 0.0, device="supa")
    dist.all_reduce(zeros, op=getattr(R, op))
    signs = [torch.empty(1000, dtype=torch.bool, device="supa") for _ in range(world)]
    dist.all_gather(signs, torch.signbit(zeros))
    assert torch.equal(signs[0], signs[1]), "ranks hold different zeros"


@distributed_test()
def test_all_reduce_of_a_non_contiguous_view_leaves_its_neighbours(rank, world):
    full = (torch.arange(24.).reshape(4, 6) + rank).to("supa")
    x = full.t()[1:5]
    dist.all_reduce(x)
    _same(x, (torch.arange(24.).reshape(4, 6) * 2 + 1).t()[1:5])
    _same(full.t()[0], torch.arange(24.).reshape(4, 6).t()[0] + rank)


@distributed_test()
def test_all_reduce_async_work_and_future(rank, world):
    x = torch.full((1000,), float(rank + 1), device="supa")
    work = dist.all_reduce(x, async_op=True)
    assert work.wait() is True
    _same(x, torch.full((1000,), 3.0))
    y = torch.full((8,), rank + 1, dtype=torch.int64, device="supa")
    dist.all_reduce(y, op=R.AVG, async_op=True).get_future().wait()
    _same(y, torch.full((8,), 1, dtype=torch.int64))


@distributed_test()
def test_reduce_to_a_root(rank, world):
    x = torch.full((5,), float(rank + 2), device="supa")
    dist.reduce(x, dst=0, op=R.MAX)
    _same(x, torch.full((5,), 3.0) if rank == 0 else torch.full((5,), float(rank + 2)))
    y = torch.full((4,), 3 * rank + 4, dtype=torch.int32, device="supa")
    dist.reduce(y, dst=1, op=R.AVG)
    _same(y, torch.full((4,), 5 if rank == 1 else 4, dtype=torch.int32))  # trunc(11 / 2); root 1 only


@distributed_test()
def test_reduce_scatter_of_a_list(rank, world):
    out = torch.empty(3, device="supa")
    dist.reduce_scatter(out, [torch.full((3,), float(rank + 10 * r), device="supa") for r in range(world)])
    _same(out, torch.full((3,), 1.0 + 20 * rank))


@distributed_test()
def test_reduce_scatter_tensor(rank, world):
    out = torch.empty(4, device="supa")
    dist.reduce_scatter_tensor(out, (torch.arange(8.0) * (rank + 1)).to("supa"))
    _same(out, (torch.arange(8.0) * 3)[4 * rank:4 * rank + 4])
    ints = torch.empty(4, dtype=torch.int64, device="supa")
    dist.reduce_scatter_tensor(ints, (torch.arange(8, dtype=torch.int64) + rank).to("supa"), op=R.AVG)
    _same(ints, torch.div(2 * torch.arange(8) + 1, 2, rounding_mode="trunc")[4 * rank:4 * rank + 4])
    bf = torch.empty(2, 2, dtype=torch.bfloat16, device="supa")
    dist.reduce_scatter_tensor(bf, torch.ones(world * 2, 2, dtype=torch.bfloat16, device="supa"), op=R.AVG)
    _same(bf, torch.ones(2, 2, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# Copies
# ------------------------------------------------------------------------------------------------
@distributed_test()
def test_broadcast(rank, world):
    x = torch.full((7,), float(rank), device="supa")
    dist.broadcast(x, src=1)
    _same(x, torch.ones(7))
    y = (torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) * (rank + 1)).to("supa").t()
    dist.broadcast(y, src=0)
    _same(y, torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t())


@distributed_test()
def test_all_gather(rank, world):
    out = [torch.empty(2, 3, device="supa") for _ in range(world)]
    dist.all_gather(out, torch.full((2, 3), float(rank), device="supa"))
    for r in range(world):
        _same(out[r], torch.full((2, 3), float(r)))


@distributed_test()
def test_all_gather_of_unequal_sizes(rank, world):
    out = [torch.empty(r + 2, device="supa") for r in range(world)]
    dist.all_gather(out, torch.arange(rank + 2.0, device="supa") + 10 * rank)
    for r in range(world):
        _same(out[r], torch.arange(r + 2.0) + 10 * r)


@distributed_test()
def test_all_gather_into_tensor_flat_stacked_and_strided(rank, world):
    flat = torch.empty(world * 3, dtype=torch.float16, device="supa")
    dist.all_gather_into_tensor(flat, torch.full((3,), float(rank), dtype=torch.float16, device="supa"))
    _same(flat, torch.tensor([0.0] * 3 + [1.0] * 3, dtype=torch.float16))
    stacked = torch.empty(world, 2, 2, device="supa")
    dist.all_gather_into_tensor(stacked, torch.full((2, 2), rank + 0.5, device="supa"))
    _same(stacked, torch.stack([torch.full((2, 2), r + 0.5) for r in range(world)]))
    strided = torch.zeros(3, world * 2, device="supa").t()[:, 1]  # a non-contiguous output
    dist.all_gather_into_tensor(strided, torch.full((2,), float(rank + 1), device="supa"))
    _same(strided, torch.tensor([1.0, 1.0, 2.0, 2.0]))


@distributed_test()
def test_all_gather_into_tensor_in_place(rank, world):
    # As ZeRO-3 and FSDP gather: the input is this rank's slot of the output.
    gathered = torch.zeros(world * 4, device="supa")
    gathered[4 * rank:4 * rank + 4] = torch.arange(4.0) + 10 * rank
    dist.all_gather_into_tensor(gathered, gathered[4 * rank:4 * rank + 4])
    _same(gathered, torch.cat([torch.arange(4.0) + 10 * r for r in range(world)]))


@distributed_test()
def test_all_gather_into_tensor_dense_on_one_rank_strided_on_the_other(rank, world):
    # Dense operands start in one native call, others are staged: both are one collective.
    mixed = torch.zeros(world * 2, device="supa") if rank == 0 else torch.zeros(3, world * 2, device="supa").t()[:, 1]
    dist.all_gather_into_tensor(mixed, torch.full((2,), float(rank + 1), device="supa"))
    _same(mixed, torch.tensor([1.0, 1.0, 2.0, 2.0]))


@distributed_test()
def test_all_to_all(rank, world):
    out = [torch.empty(r + 1, device="supa") for r in range(world)]
    dist.all_to_all(out, [torch.full((rank + 1,), float(10 * rank + r), device="supa") for r in range(world)])
    for r in range(world):
        _same(out[r], torch.full((r + 1,), float(10 * r + rank)))


@distributed_test()
def test_all_to_all_single_equal_splits(rank, world):
    out = torch.empty(4, 2, device="supa")
    dist.all_to_all_single(out, (torch.arange(8.0).reshape(4, 2) + 100 * rank).to("supa"))
    _same(out, torch.cat([(torch.arange(8.0).reshape(4, 2) + 100 * r)[2 * rank:2 * rank + 2] for r in range(world)]))


@distributed_test()
def test_all_to_all_single_unequal_splits(rank, world):
    send = {0: [1, 2], 1: [3, 1]}  # send[r][p]: rows rank r sends to p
    receive = [send[p][rank] for p in range(world)]
    out = torch.empty(sum(receive), device="supa")
    dist.all_to_all_single(out, (torch.arange(float(sum(send[rank]))) + 100 * rank).to("supa"), receive, send[rank])
    pieces = []
    for p in range(world):
        start = sum(send[p][:rank])
        pieces.append(torch.arange(float(sum(send[p])))[start:start + send[p][rank]] + 100 * p)
    _same(out, torch.cat(pieces))


@distributed_test()
def test_gather_to_a_root(rank, world):
    out = [torch.empty(3, device="supa") for _ in range(world)] if rank == 1 else None
    dist.gather(torch.full((3,), float(rank + 1), device="supa"), out, dst=1)
    if rank == 1:
        for r in range(world):
            _same(out[r], torch.full((3,), float(r + 1)))


@distributed_test()
def test_scatter_from_a_root(rank, world):
    out = torch.empty(2, dtype=torch.int32, device="supa")
    chunks = [torch.full((2,), 7 * r, dtype=torch.int32, device="supa") for r in range(world)] if rank == 0 else None
    dist.scatter(out, chunks, src=0)
    _same(out, torch.full((2,), 7 * rank, dtype=torch.int32))


@distributed_test()
def test_barrier_waits_for_every_rank(rank, world):
    store = rank_store()
    if rank == 0:
        time.sleep(0.2)  # rank 1 is in the barrier first
        store.set("before the barrier", "rank 0")
    dist.barrier()
    assert store.check(["before the barrier"]), "rank 1 left the barrier before rank 0 entered it"


# ------------------------------------------------------------------------------------------------
# Point to point
# ------------------------------------------------------------------------------------------------
@distributed_test()
def test_send_and_recv(rank, world):
    if rank == 0:
        dist.send(torch.arange(5.0, device="supa"), dst=1)
        back = torch.empty(6, dtype=torch.bfloat16, device="supa")
        dist.recv(back, src=1)
        _same(back, torch.ones(6, dtype=torch.bfloat16))
    else:
        x = torch.empty(5, device="supa")
        dist.recv(x, src=0)
        _same(x, torch.arange(5.0))
        dist.send(torch.ones(6, dtype=torch.bfloat16, device="supa"), dst=0)


@distributed_test()
def test_isend_and_irecv_into_a_non_contiguous_buffer(rank, world):
    other = 1 - rank
    theirs = torch.zeros(8, device="supa")[::2]
    sent = dist.isend(torch.full((4,), float(rank), device="supa"), dst=other)
    received = dist.irecv(theirs, src=other)
    sent.wait()
    received.wait()
    _same(theirs, torch.full((4,), float(other)))


@distributed_test()
def test_batch_isend_irecv(rank, world):
    other = 1 - rank
    theirs = torch.empty(3, device="supa")
    mine = torch.full((3,), float(rank + 5), device="supa")
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, other), dist.P2POp(dist.irecv, theirs, other)]):
        work.wait()
    _same(theirs, torch.full((3,), float(other + 5)))


# ------------------------------------------------------------------------------------------------
# Coalesced calls, objects, subgroups
# ------------------------------------------------------------------------------------------------
@distributed_test()
def test_all_reduce_coalesced(rank, world):
    xs = [torch.ones(3, device="supa") * (rank + 1), torch.ones(2, 2, device="supa")]
    dist.all_reduce_coalesced(xs, op=R.SUM)
    _same(xs[0], torch.full((3,), 3.0))
    _same(xs[1], torch.full((2, 2), 2.0))


@distributed_test()
def test_coalescing_manager_as_deepspeed_comm_uses_it(rank, world):
    # What deepspeed.comm does for all_gather_coalesced and reduce_scatter_coalesced.
    outs = [torch.empty(4, device="supa"), torch.empty(2, device="supa")]
    ins = [torch.full((2,), float(rank), device="supa"), torch.full((1,), float(rank + 3), device="supa")]
    with dist._coalescing_manager(device="supa", async_ops=True) as cm:
        for out, inp in zip(outs, ins):
            dist.all_gather_into_tensor(out, inp, async_op=True)
    cm.wait()
    _same(outs[0], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    _same(outs[1], torch.tensor([3.0, 4.0]))
    routs = [torch.empty(2, device="supa"), torch.empty(1, device="supa")]
    with dist._coalescing_manager(device="supa"):
        for out, n in zip(routs, (4, 2)):
            dist.reduce_scatter_tensor(out, torch.arange(float(n), device="supa") + rank)
    _same(routs[0], (2 * torch.arange(4.0) + 1)[2 * rank:2 * rank + 2])
    _same(routs[1], (2 * torch.arange(2.0) + 1)[rank:rank + 1])


@distributed_test()
def test_coalescing_manager_applies_one_reduce_op_to_the_batch(rank, world):
    # torch applies the first call's op to the whole batch.
    xs = [torch.full((2,), rank + 1.0, device="supa"), torch.full((3,), 2 * rank + 1, dtype=torch.int64, device="supa")]
    with dist._coalescing_manager(device="supa"):
        dist.all_reduce(xs[0], op=R.AVG)
        dist.all_reduce(xs[1], op=R.AVG)
    _same(xs[0], torch.full((2,), 1.5))
    _same(xs[1], torch.full((3,), 2, dtype=torch.int64))


@distributed_test()
def test_coalesced_tensor_variants(rank, world):
    group = dist.group.WORLD
    outs = [torch.empty(4, device="supa"), torch.empty(2, device="supa")]
    group.allgather_into_tensor_coalesced(
        outs, [torch.full((2,), float(rank), device="supa"), torch.full((1,), 1.0, device="supa")]).wait()
    _same(outs[0], torch.tensor([0.0, 0.0, 1.0, 1.0]))
    routs = [torch.empty(1, device="supa")]
    group.reduce_scatter_tensor_coalesced(routs, [torch.arange(2.0, device="supa")], dist.ReduceScatterOptions()).wait()
    _same(routs[0], torch.tensor([2.0 * rank]))
    lists = [[torch.empty(2, device="supa"), torch.empty(1, device="supa")] for _ in range(world)]
    dist.all_gather_coalesced(lists, [torch.full((2,), float(rank), device="supa"), torch.full((1,), 9.0, device="supa")])
    _same(lists[1][0], torch.ones(2))
    _same(lists[0][1], torch.tensor([9.0]))


@distributed_test()
def test_object_collectives(rank, world):
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank})
    assert gathered == [{"rank": 0}, {"rank": 1}]
    box = [f"from {rank}"]
    dist.broadcast_object_list(box, src=1)
    assert box == ["from 1"]


@distributed_test()
def test_subgroups_of_both_ranks_and_of_one(rank, world):
    pair = dist.new_group([0, 1])
    assert type(pair).__name__ == "ProcessGroupBCCL" and dist.get_world_size(pair) == 2, pair
    x = torch.ones(3, device="supa")
    dist.all_reduce(x, group=pair)
    _same(x, torch.full((3,), 2.0))
    solo = {r: dist.new_group([r]) for r in range(world)}
    y = torch.full((2,), float(rank), device="supa")
    dist.all_reduce(y, group=solo[rank])
    _same(y, torch.full((2,), float(rank)))
    out = torch.empty(world, device="supa")
    dist.all_gather_into_tensor(out, torch.full((1,), float(rank), device="supa"), group=pair)
    _same(out, torch.arange(float(world)))


# ------------------------------------------------------------------------------------------------
# Refused calls: the emulator's errors, and the group stays usable
# ------------------------------------------------------------------------------------------------
@pytest.mark.emulation_only
@distributed_test()
def test_a_cpu_tensor_is_refused_naming_both_devices(rank, world):
    with pytest.raises(ValueError) as caught:
        dist.all_reduce(torch.ones(2))
    assert "cpu" in str(caught.value) and "supa" in str(caught.value), caught.value


@pytest.mark.emulation_only
@distributed_test()
def test_mismatched_shapes_fail_on_every_rank(rank, world):
    _raises_mismatch(lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 8, device="supa")), "numel=4", "numel=8")
    _raises_mismatch(lambda: dist.all_gather_into_tensor(torch.empty(world * (2 + rank), device="supa"),
                                                         torch.ones(2 + rank, device="supa")))
    _group_still_works()


@pytest.mark.emulation_only
@distributed_test()
def test_wrong_output_sizes_are_refused(rank, world):
    with pytest.raises(ValueError, match="as many output as input tensors, got 2 and 1"):
        dist.group.WORLD.reduce_scatter_tensor_coalesced([torch.empty(2, device="supa")] * 2,
                                                         [torch.ones(4, device="supa")])
    with pytest.raises(ValueError, match="all_gather_into_tensor"):
        dist.all_gather_into_tensor(torch.empty(3, device="supa"), torch.ones(2, device="supa"))


def _call(name: str, n: int, world: int):
    """One collective of `n` elements per rank, by name (the pairs below)."""
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(n, device="supa")),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(world * n, device="supa"), torch.ones(n, device="supa")),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(n, device="supa"), torch.ones(world * n, device="supa")),
        "broadcast": lambda: dist.broadcast(torch.ones(n, device="supa"), src=0),
        "barrier": lambda: dist.barrier(),
        "gather": lambda: dist.gather(torch.ones(n, device="supa"),
                                      [torch.empty(n, device="supa") for _ in range(world)]
                                      if dist.get_rank() == 0 else None),
    }
    return calls[name]


_MISMATCHED_PAIRS = [("all_reduce", "all_reduce"), ("all_gather_into_tensor", "all_gather_into_tensor"),
                     ("reduce_scatter_tensor", "reduce_scatter_tensor"), ("broadcast", "broadcast"),
                     ("barrier", "all_reduce"), ("all_reduce", "barrier"), ("all_reduce", "gather"),
                     ("all_gather_into_tensor", "reduce_scatter_tensor")]


@pytest.mark.emulation_only
@distributed_test()
def test_a_mismatch_after_the_peer_started_fails_on_both_ranks(rank, world):
    # A rank alone at a collective starts it in gloo before its peer has posted a signature; the
    # peer that then disagrees must let that gloo operation finish and both must raise.
    for first in range(world):
        for first_calls, then_calls in _MISMATCHED_PAIRS:
            dist.barrier()
            if rank != first:
                time.sleep(0.2)  # the first rank's signature is alone on the board when it starts
            call = _call(first_calls, 4, world) if rank == first else _call(then_calls, 8, world)
            _raises_mismatch(call, what=f"{first_calls} against {then_calls} (rank {first} first)")
    _group_still_works()


@pytest.mark.emulation_only
@distributed_test()
def test_an_asynchronous_mismatch_reports_through_its_work(rank, world):
    dist.barrier()
    if rank == 1:
        time.sleep(0.2)
        _raises_mismatch(lambda: dist.all_reduce(torch.ones(8, device="supa")))
    else:
        work = dist.all_reduce(torch.ones(4, device="supa"), async_op=True)
        deadline = time.monotonic() + 60
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert work.is_completed() and "mismatch" in str(work.exception()), work.exception()
        _raises_mismatch(work.wait, "numel=4", "numel=8")
    _group_still_works()


# ------------------------------------------------------------------------------------------------
# A peer that dies or stalls: the survivor fails with NCCL's error type instead of hanging
# ------------------------------------------------------------------------------------------------
def _init_group(rank: int, world: int, timeout_s: float) -> None:
    dist.init_process_group("bccl", store=rank_store(), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


@pytest.mark.emulation_only
@pytest.mark.slow  # waits for a peer to die
@distributed_test(backend=None)
def test_dead_peer_fails_the_survivor(rank, world):
    _init_group(rank, world, timeout_s=20)
    x = torch.ones(4, device="supa")
    dist.all_reduce(x)
    if rank == 1:
        exit_rank(3)  # no clean shutdown
    assert dist.group.WORLD.options._timeout == datetime.timedelta(seconds=20)  # init's timeout reaches the group
    with pytest.raises(dist.DistBackendError) as caught:
        dist.all_reduce(x)
    assert caught.type is dist.DistBackendError  # what NCCL raises for a lost peer
    assert "rank 1" in str(caught.value) and "exited" in str(caught.value), caught.value
    exit_rank(0)  # the group lost a rank: no teardown


@pytest.mark.emulation_only
@pytest.mark.slow  # waits for a peer to die
@distributed_test(backend=None)
def test_peer_dying_inside_gloo_fails_the_survivor(rank, world):
    _init_group(rank, world, timeout_s=20)
    x = torch.ones(16 << 20, device="supa")
    if rank == 1:
        dist.all_reduce(x, async_op=True)
        exit_rank(3)  # rank 0 is inside gloo when it happens
    with pytest.raises(dist.DistBackendError) as caught:
        dist.all_reduce(x)
        dist.all_reduce(x)  # in case the first finished before the peer went away
    assert caught.type is dist.DistBackendError
    exit_rank(0)


@pytest.mark.emulation_only
@pytest.mark.slow  # waits out the group's timeout
@distributed_test(backend=None)
def test_stalled_peer_times_out(rank, world):
    _init_group(rank, world, timeout_s=5)
    store = rank_store()  # served by rank 0: it waits for rank 1 to leave first
    if rank == 1:  # alive, but never joins: lives on until rank 0 is done
        store.wait(["rank 0 done"])
        store.set("rank 1 leaves", "1")
        exit_rank(0)
    try:
        with pytest.raises(dist.DistBackendError, match="timed out") as caught:
            dist.all_reduce(torch.ones(4, device="supa"))
        assert caught.type is dist.DistBackendError  # NCCL's type for a timeout
    finally:
        store.set("rank 0 done", "1")
        store.wait(["rank 1 leaves"])
    exit_rank(0)


# ------------------------------------------------------------------------------------------------
# Three ranks: small buffers are exchanged and reduced in rank order by bccl, large ones go to
# gloo's ring; every rank must hold the rank-order result
# ------------------------------------------------------------------------------------------------
def _contribution(source: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(100 + source)) * 4
    return values.to(dtype) if dtype.is_floating_point else values.round().to(dtype)


def _rank_order(world: int, dtype: torch.dtype, op: str, numel: int) -> torch.Tensor:
    folds = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum}
    result = _contribution(0, dtype, numel)
    for source in range(1, world):
        result = folds[op](result, _contribution(source, dtype, numel))
    if op == "AVG":
        result = result / world if dtype.is_floating_point else torch.div(result, world, rounding_mode="trunc")
    return result


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("op", OPS)
@distributed_test(world=3)
def test_three_ranks_all_reduce_in_rank_order(rank, world, dtype, op):
    dtype = getattr(torch, dtype)
    x = _contribution(rank, dtype, 3000).to("supa")
    dist.all_reduce(x, op=getattr(R, op))
    _same(x, _rank_order(world, dtype, op, 3000))


@distributed_test(world=3)
def test_three_ranks_all_reduce_past_the_exchange(rank, world):
    # 200,000 float32 elements (800 KB, sent to 2 peers) are past bccl's exchange limit.
    x = _contribution(rank, torch.float32, 200_000).to("supa")
    dist.all_reduce(x)
    torch.testing.assert_close(x.cpu(), _rank_order(world, torch.float32, "SUM", 200_000))
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    assert all(torch.equal(other, x) for other in gathered), "ranks disagree"


@distributed_test(world=3)
def test_three_ranks_all_gather_into_tensor(rank, world):
    out = torch.empty(world * 5, device="supa")
    dist.all_gather_into_tensor(out, torch.arange(5.0, device="supa") + 10 * rank)
    _same(out, torch.cat([torch.arange(5.0) + 10 * r for r in range(world)]))
    out.zero_()[5 * rank:5 * rank + 5] = torch.arange(5.0) + 10 * rank
    dist.all_gather_into_tensor(out, out[5 * rank:5 * rank + 5])  # in place
    _same(out, torch.cat([torch.arange(5.0) + 10 * r for r in range(world)]))


@distributed_test(world=3)
def test_three_ranks_reduce_scatter_tensor(rank, world):
    out = torch.empty(4, dtype=torch.bfloat16, device="supa")
    dist.reduce_scatter_tensor(out, _contribution(rank, torch.bfloat16, world * 4).to("supa"))
    _same(out, _rank_order(world, torch.bfloat16, "SUM", world * 4)[4 * rank:4 * rank + 4])
