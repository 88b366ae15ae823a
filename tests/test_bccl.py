"""The bccl backend: every collective DeepSpeed uses, on supa tensors, across real processes.

Each job starts 2 ranks as separate interpreters (SUPA_EMULATE=1, rank r on supa:r) and runs a
scenario from this file; process start-up dominates, so one job runs many checks and the tests
below read their outcomes. Expected values are computed independently on the CPU.

The collective semantics hold on real cards too (with a real torch_supa installed the emulator
stands down and SUPA_EMULATE=1 changes nothing), so only the checks of the emulator's own
behaviour (its error texts, its group object, the cross-rank signature check and the dead/stalled
peer detection it builds on) are marked `emulation_only`.
"""

import datetime
import os
import time

import pytest
from harness import RankChecks, run_ranks, serve_rank
import torch  # noqa: F401  (activates the emulator in this process, as the other test modules do)

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

WORLD = 2


# ------------------------------------------------------------------------------------------------
# Worker side (runs in the spawned ranks)
# ------------------------------------------------------------------------------------------------
def _init(rank: int, port: int, timeout_s: float = 0, world: int = WORLD):
    import torch
    import torch.distributed as dist

    torch.accelerator.set_device_index(rank)  # bccl was registered when torch activated supa
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("bccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kwargs)
    return torch.device("supa", rank)


def _scenario_collectives(rank: int, port: int) -> dict:
    import torch
    import torch.distributed as dist

    R = dist.ReduceOp
    dev = _init(rank, port)
    other = 1 - rank
    check = RankChecks()

    def same(actual, expected):
        assert actual.device == dev, f"result moved to {actual.device}"
        assert torch.equal(actual.cpu(), expected), f"{actual.cpu()} != {expected}"

    check("group_type", lambda: _expect(type(dist.group.WORLD).__name__ == "ProcessGroupBCCL"
                                        and dist.get_backend() == "bccl", "not a bccl group"))
    check("default_timeout", lambda: _expect(
        dist.group.WORLD.options._timeout == datetime.timedelta(minutes=10), dist.group.WORLD.options._timeout))

    base = {0: torch.tensor([1, 3, -5, 7, 2]), 1: torch.tensor([2, 3, -6, 1, 2])}
    reference = {
        "SUM": base[0] + base[1], "PRODUCT": base[0] * base[1],
        "MIN": torch.minimum(base[0], base[1]), "MAX": torch.maximum(base[0], base[1]),
    }
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
            def all_reduce(dtype=dtype, op=op):
                x = base[rank].to(dtype).to(dev)
                dist.all_reduce(x, op=getattr(R, op))
                if op == "AVG":
                    total = (base[0] + base[1]).to(dtype)
                    expected = total / 2 if dtype.is_floating_point else torch.div(total, 2, rounding_mode="trunc")
                else:
                    expected = reference[op].to(dtype)
                same(x, expected.to(dtype))
            check(f"all_reduce/{str(dtype)[6:]}/{op}", all_reduce)

            def reduce_scatter_tensor_op(dtype=dtype, op=op):
                # bccl reduces this one itself after an all-to-all: each rank gets 2 of the 4 elements.
                out = torch.empty(2, 1, dtype=dtype, device=dev).t()  # non-contiguous: staged and written back
                dist.reduce_scatter_tensor(out, base[rank][:4].to(dtype).to(dev), op=getattr(R, op))
                if op == "AVG":
                    total = (base[0] + base[1]).to(dtype)
                    expected = total / 2 if dtype.is_floating_point else torch.div(total, 2, rounding_mode="trunc")
                else:
                    expected = reference[op].to(dtype)
                same(out, expected[2 * rank:2 * rank + 2].to(dtype).view(1, 2))
            check(f"reduce_scatter_tensor/{str(dtype)[6:]}/{op}", reduce_scatter_tensor_op)

    def all_reduce_matches_gloo():
        # bccl reduces all_reduce itself after an exchange; with 2 ranks its bits must be gloo's.
        gloo = dist.new_group(backend="gloo")
        generator = torch.Generator().manual_seed(1234 + rank)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for op in ("SUM", "PRODUCT", "MIN", "MAX"):
                # 40,000 float32 elements: 160 KB; 2,500,000 (10 MB) are past the exchange: gloo's ring.
                for numel in (1000, 40_000) + ((2_500_000,) if dtype == torch.float32 and op == "SUM" else ()):
                    data = torch.randn(numel, generator=generator).to(dtype)
                    on_device, on_host = data.to(dev), data.clone()
                    dist.all_reduce(on_device, op=getattr(R, op))
                    dist.all_reduce(on_host, op=getattr(R, op), group=gloo)
                    assert torch.equal(on_device.cpu().view(torch.int8), on_host.view(torch.int8)), (dtype, op, numel)
        dist.destroy_process_group(gloo)
        # MIN/MAX of -0.0 and 0.0 depend on operand order (gloo's pick varies with the element's
        # position in its ring chunks); bccl's must at least be the same on every rank.
        for op in (R.MIN, R.MAX):
            zeros = torch.full((1000,), -0.0 if rank == 0 else 0.0, device=dev)
            dist.all_reduce(zeros, op=op)
            signs = [torch.empty(1000, dtype=torch.bool, device=dev) for _ in range(WORLD)]
            dist.all_gather(signs, torch.signbit(zeros))
            assert torch.equal(signs[0], signs[1]), f"{op}: ranks hold different zeros"
    check("all_reduce/matches_gloo", all_reduce_matches_gloo)

    def all_reduce_non_contiguous():
        full = (torch.arange(24.).reshape(4, 6) + rank).to(dev)
        x = full.t()[1:5]
        dist.all_reduce(x)
        expected = (torch.arange(24.).reshape(4, 6) * 2 + 1).t()[1:5]
        same(x, expected)
        same(full.t()[0], torch.arange(24.).reshape(4, 6).t()[0] + rank)  # untouched neighbours
    check("all_reduce/non_contiguous", all_reduce_non_contiguous)

    def all_reduce_async():
        x = torch.full((1000,), float(rank + 1), device=dev)
        work = dist.all_reduce(x, async_op=True)
        assert work.wait() is True
        same(x, torch.full((1000,), 3.0))
        y = torch.full((8,), rank + 1, dtype=torch.int64, device=dev)
        fut = dist.all_reduce(y, op=R.AVG, async_op=True).get_future()
        fut.wait()
        same(y, torch.full((8,), 1, dtype=torch.int64))
    check("async/all_reduce", all_reduce_async)

    def broadcast():
        x = torch.full((7,), float(rank), device=dev)
        dist.broadcast(x, src=1)
        same(x, torch.ones(7))
        y = (torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) * (rank + 1)).to(dev).t()
        dist.broadcast(y, src=0)
        same(y, torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t())
    check("broadcast", broadcast)

    def reduce():
        x = torch.full((5,), float(rank + 2), device=dev)
        dist.reduce(x, dst=0, op=R.MAX)
        same(x, torch.full((5,), 3.0) if rank == 0 else torch.full((5,), float(rank + 2)))
        y = torch.full((4,), 3 * rank + 4, dtype=torch.int32, device=dev)
        dist.reduce(y, dst=1, op=R.AVG)
        same(y, torch.full((4,), 5 if rank == 1 else 4, dtype=torch.int32))  # trunc(11 / 2); root 1 only
    check("reduce", reduce)

    def all_gather():
        out = [torch.empty(2, 3, device=dev) for _ in range(WORLD)]
        dist.all_gather(out, torch.full((2, 3), float(rank), device=dev))
        for r in range(WORLD):
            same(out[r], torch.full((2, 3), float(r)))
    check("all_gather", all_gather)

    def all_gather_unequal():
        out = [torch.empty(r + 2, device=dev) for r in range(WORLD)]
        dist.all_gather(out, torch.arange(rank + 2.0, device=dev) + 10 * rank)
        for r in range(WORLD):
            same(out[r], torch.arange(r + 2.0) + 10 * r)
    check("all_gather/unequal_sizes", all_gather_unequal)

    def all_gather_into_tensor():
        flat = torch.empty(WORLD * 3, dtype=torch.float16, device=dev)
        dist.all_gather_into_tensor(flat, torch.full((3,), float(rank), dtype=torch.float16, device=dev))
        same(flat, torch.tensor([0.0] * 3 + [1.0] * 3, dtype=torch.float16))
        stacked = torch.empty(WORLD, 2, 2, device=dev)
        dist.all_gather_into_tensor(stacked, torch.full((2, 2), rank + 0.5, device=dev))
        same(stacked, torch.stack([torch.full((2, 2), r + 0.5) for r in range(WORLD)]))
        strided = torch.zeros(3, WORLD * 2, device=dev).t()[:, 1]  # a non-contiguous output
        dist.all_gather_into_tensor(strided, torch.full((2,), float(rank + 1), device=dev))
        same(strided, torch.tensor([1.0, 1.0, 2.0, 2.0]))
        # In place, as ZeRO-3 and FSDP gather: the input is this rank's slot of the output.
        gathered = torch.zeros(WORLD * 4, device=dev)
        gathered[4 * rank:4 * rank + 4] = torch.arange(4.0) + 10 * rank
        dist.all_gather_into_tensor(gathered, gathered[4 * rank:4 * rank + 4])
        same(gathered, torch.cat([torch.arange(4.0) + 10 * r for r in range(WORLD)]))
        # Dense operands start in one native call, others are staged: both are one collective.
        mixed = torch.zeros(WORLD * 2, device=dev) if rank == 0 else torch.zeros(3, WORLD * 2, device=dev).t()[:, 1]
        dist.all_gather_into_tensor(mixed, torch.full((2,), float(rank + 1), device=dev))
        same(mixed, torch.tensor([1.0, 1.0, 2.0, 2.0]))
    check("all_gather_into_tensor", all_gather_into_tensor)

    def reduce_scatter():
        out = torch.empty(3, device=dev)
        dist.reduce_scatter(out, [torch.full((3,), float(rank + 10 * r), device=dev) for r in range(WORLD)])
        same(out, torch.full((3,), 1.0 + 20 * rank))
    check("reduce_scatter", reduce_scatter)

    def reduce_scatter_tensor():
        full = torch.arange(8.0) * (rank + 1)
        out = torch.empty(4, device=dev)
        dist.reduce_scatter_tensor(out, full.to(dev))
        same(out, (torch.arange(8.0) * 3)[4 * rank:4 * rank + 4])
        ints = torch.arange(8, dtype=torch.int64) + rank
        iout = torch.empty(4, dtype=torch.int64, device=dev)
        dist.reduce_scatter_tensor(iout, ints.to(dev), op=R.AVG)
        same(iout, torch.div(2 * torch.arange(8) + 1, 2, rounding_mode="trunc")[4 * rank:4 * rank + 4])
        bf = torch.empty(2, 2, dtype=torch.bfloat16, device=dev)
        dist.reduce_scatter_tensor(bf, torch.ones(WORLD * 2, 2, dtype=torch.bfloat16, device=dev), op=R.AVG)
        same(bf, torch.ones(2, 2, dtype=torch.bfloat16))
    check("reduce_scatter_tensor", reduce_scatter_tensor)

    def all_to_all():
        out = [torch.empty(r + 1, device=dev) for r in range(WORLD)]
        dist.all_to_all(out, [torch.full((rank + 1,), float(10 * rank + r), device=dev) for r in range(WORLD)])
        for r in range(WORLD):
            same(out[r], torch.full((r + 1,), float(10 * r + rank)))
    check("all_to_all", all_to_all)

    def all_to_all_single_equal():
        out = torch.empty(4, 2, device=dev)
        inp = (torch.arange(8.0).reshape(4, 2) + 100 * rank).to(dev)
        dist.all_to_all_single(out, inp)
        expected = torch.cat([(torch.arange(8.0).reshape(4, 2) + 100 * r)[2 * rank:2 * rank + 2] for r in range(WORLD)])
        same(out, expected)
    check("all_to_all_single/equal", all_to_all_single_equal)

    def all_to_all_single_unequal():
        send = {0: [1, 2], 1: [3, 1]}  # send[r][p]: rows rank r sends to p
        receive = [send[p][rank] for p in range(WORLD)]
        inp = (torch.arange(float(sum(send[rank]))) + 100 * rank).to(dev)
        out = torch.empty(sum(receive), device=dev)
        dist.all_to_all_single(out, inp, receive, send[rank])
        pieces = []
        for p in range(WORLD):
            start = sum(send[p][:rank])
            pieces.append(torch.arange(float(sum(send[p])))[start:start + send[p][rank]] + 100 * p)
        same(out, torch.cat(pieces))
    check("all_to_all_single/unequal", all_to_all_single_unequal)

    def gather():
        out = [torch.empty(3, device=dev) for _ in range(WORLD)] if rank == 1 else None
        dist.gather(torch.full((3,), float(rank + 1), device=dev), out, dst=1)
        if rank == 1:
            for r in range(WORLD):
                same(out[r], torch.full((3,), float(r + 1)))
    check("gather", gather)

    def scatter():
        out = torch.empty(2, dtype=torch.int32, device=dev)
        chunks = [torch.full((2,), 7 * r, dtype=torch.int32, device=dev) for r in range(WORLD)] if rank == 0 else None
        dist.scatter(out, chunks, src=0)
        same(out, torch.full((2,), 7 * rank, dtype=torch.int32))
    check("scatter", scatter)

    check("barrier", lambda: dist.barrier())

    def send_recv():
        if rank == 0:
            dist.send(torch.arange(5.0, device=dev), dst=1)
            back = torch.empty(6, dtype=torch.bfloat16, device=dev)
            dist.recv(back, src=1)
            same(back, torch.ones(6, dtype=torch.bfloat16))
        else:
            x = torch.empty(5, device=dev)
            dist.recv(x, src=0)
            same(x, torch.arange(5.0))
            dist.send(torch.ones(6, dtype=torch.bfloat16, device=dev), dst=0)
    check("send_recv", send_recv)

    def isend_irecv():
        mine = torch.full((4,), float(rank), device=dev)
        theirs = torch.zeros(8, device=dev)[::2]  # non-contiguous receive buffer
        sent = dist.isend(mine, dst=other)
        received = dist.irecv(theirs, src=other)
        sent.wait()
        received.wait()
        same(theirs, torch.full((4,), float(other)))
    check("isend_irecv", isend_irecv)

    def batch_isend_irecv():
        mine = torch.full((3,), float(rank + 5), device=dev)
        theirs = torch.empty(3, device=dev)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, other), dist.P2POp(dist.irecv, theirs, other)])
        for work in works:
            work.wait()
        same(theirs, torch.full((3,), float(other + 5)))
    check("batch_isend_irecv", batch_isend_irecv)

    def all_reduce_coalesced():
        xs = [torch.ones(3, device=dev) * (rank + 1), torch.ones(2, 2, device=dev)]
        dist.all_reduce_coalesced(xs, op=R.SUM)
        same(xs[0], torch.full((3,), 3.0))
        same(xs[1], torch.full((2, 2), 2.0))
    check("all_reduce_coalesced", all_reduce_coalesced)

    def coalescing_manager():
        # What deepspeed.comm does for all_gather_coalesced and reduce_scatter_coalesced.
        outs = [torch.empty(4, device=dev), torch.empty(2, device=dev)]
        ins = [torch.full((2,), float(rank), device=dev), torch.full((1,), float(rank + 3), device=dev)]
        reqs = []
        with dist._coalescing_manager(device=dev, async_ops=True) as cm:
            for out, inp in zip(outs, ins):
                reqs.append(dist.all_gather_into_tensor(out, inp, async_op=True))
        cm.wait()
        same(outs[0], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        same(outs[1], torch.tensor([3.0, 4.0]))
        routs = [torch.empty(2, device=dev), torch.empty(1, device=dev)]
        with dist._coalescing_manager(device=dev):
            for out, n in zip(routs, (4, 2)):
                dist.reduce_scatter_tensor(out, torch.arange(float(n), device=dev) + rank)
        same(routs[0], (2 * torch.arange(4.0) + 1)[2 * rank:2 * rank + 2])
        same(routs[1], (2 * torch.arange(2.0) + 1)[rank:rank + 1])
        # One reduce op per coalesced batch (torch applies the first op to the whole batch).
        xs = [torch.full((2,), rank + 1.0, device=dev), torch.full((3,), 2 * rank + 1, dtype=torch.int64, device=dev)]
        with dist._coalescing_manager(device=dev):
            dist.all_reduce(xs[0], op=R.AVG)
            dist.all_reduce(xs[1], op=R.AVG)
        same(xs[0], torch.full((2,), 1.5))
        same(xs[1], torch.full((3,), 2, dtype=torch.int64))
    check("coalescing_manager", coalescing_manager)

    def coalesced_tensor_variants():
        group = dist.group.WORLD
        outs = [torch.empty(4, device=dev), torch.empty(2, device=dev)]
        group.allgather_into_tensor_coalesced(
            outs, [torch.full((2,), float(rank), device=dev), torch.full((1,), 1.0, device=dev)]).wait()
        same(outs[0], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        routs = [torch.empty(1, device=dev)]
        group.reduce_scatter_tensor_coalesced(routs, [torch.arange(2.0, device=dev)], dist.ReduceScatterOptions()).wait()
        same(routs[0], torch.tensor([2.0 * rank]))
        lists = [[torch.empty(2, device=dev), torch.empty(1, device=dev)] for _ in range(WORLD)]
        dist.all_gather_coalesced(lists, [torch.full((2,), float(rank), device=dev), torch.full((1,), 9.0, device=dev)])
        same(lists[1][0], torch.ones(2))
        same(lists[0][1], torch.tensor([9.0]))
    check("coalesced_tensor_variants", coalesced_tensor_variants)

    def object_collectives():
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, {"rank": rank})
        _expect(gathered == [{"rank": 0}, {"rank": 1}], gathered)
        box = [f"from {rank}"]
        dist.broadcast_object_list(box, src=1)
        _expect(box == ["from 1"], box)
    check("object_collectives", object_collectives)

    def subgroups():
        pair = dist.new_group([0, 1])
        x = torch.ones(3, device=dev)
        dist.all_reduce(x, group=pair)
        same(x, torch.full((3,), 2.0))
        solo = {r: dist.new_group([r]) for r in range(WORLD)}
        y = torch.full((2,), float(rank), device=dev)
        dist.all_reduce(y, group=solo[rank])
        same(y, torch.full((2,), float(rank)))
        _expect(type(pair).__name__ == "ProcessGroupBCCL" and dist.get_world_size(pair) == 2, pair)
        out = torch.empty(WORLD, device=dev)
        dist.all_gather_into_tensor(out, torch.full((1,), float(rank), device=dev), group=pair)
        same(out, torch.arange(float(WORLD)))
    check("subgroups", subgroups)

    def cpu_tensor_rejected():
        try:
            dist.all_reduce(torch.ones(2))
        except ValueError as error:
            _expect("cpu" in str(error) and "supa" in str(error), error)
            return
        raise AssertionError("a CPU tensor was accepted")
    check("cpu_tensor_rejected", cpu_tensor_rejected)

    def must_raise_mismatch(call, what, *details):
        try:
            call()
        except RuntimeError as error:
            _expect("mismatch" in str(error) and all(d in str(error) for d in details), error)
        else:
            raise AssertionError(f"{what} did not fail")

    def group_still_works():
        z = torch.ones(2, device=dev)
        dist.all_reduce(z)
        same(z, torch.full((2,), 2.0))

    def mismatched_shapes():
        must_raise_mismatch(lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 8, device=dev)),
                            "mismatched all_reduce", "numel=4", "numel=8")
        must_raise_mismatch(lambda: dist.all_gather_into_tensor(torch.empty(WORLD * (2 + rank), device=dev),
                                                                torch.ones(2 + rank, device=dev)),
                            "mismatched all_gather_into_tensor")
        group_still_works()  # after a rejected call
    check("mismatched_shapes", mismatched_shapes)

    def wrong_output_size():
        try:
            group = dist.group.WORLD
            group.reduce_scatter_tensor_coalesced([torch.empty(2, device=dev)] * 2, [torch.ones(4, device=dev)])
        except ValueError as error:
            _expect("as many output as input tensors, got 2 and 1" in str(error), error)
        else:
            raise AssertionError("a coalesced call with more outputs than inputs was accepted")
        try:
            dist.all_gather_into_tensor(torch.empty(3, device=dev), torch.ones(2, device=dev))
        except ValueError as error:
            _expect("all_gather_into_tensor" in str(error), error)
            return
        raise AssertionError("wrong output size accepted")
    check("wrong_output_size", wrong_output_size)

    # A rank alone at a collective starts it in gloo before its peer has posted a signature; the
    # peer that then disagrees must let that gloo operation finish and both must raise.
    def mine_or_theirs(n):
        return {
            "all_reduce": lambda: dist.all_reduce(torch.ones(n, device=dev)),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
                torch.empty(WORLD * n, device=dev), torch.ones(n, device=dev)),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
                torch.empty(n, device=dev), torch.ones(WORLD * n, device=dev)),
            "broadcast": lambda: dist.broadcast(torch.ones(n, device=dev), src=0),
            "barrier": lambda: dist.barrier(),
            "gather": lambda: dist.gather(
                torch.ones(n, device=dev), [torch.empty(n, device=dev) for _ in range(WORLD)] if rank == 0 else None),
        }

    pairs = [("all_reduce", "all_reduce"), ("all_gather_into_tensor", "all_gather_into_tensor"),
             ("reduce_scatter_tensor", "reduce_scatter_tensor"), ("broadcast", "broadcast"),
             ("barrier", "all_reduce"), ("all_reduce", "barrier"), ("all_reduce", "gather"),
             ("all_gather_into_tensor", "reduce_scatter_tensor")]

    def mismatch_after_peer_started():
        for first in range(WORLD):
            for first_calls, then_calls in pairs:
                dist.barrier()
                if rank != first:
                    time.sleep(0.2)  # the first rank's signature is alone on the board when it starts
                calls = mine_or_theirs(4 if rank == first else 8)[first_calls if rank == first else then_calls]
                must_raise_mismatch(calls, f"{first_calls} against {then_calls} (rank {first} first)")
        # An asynchronous one reports through its work, and the group stays usable.
        dist.barrier()
        if rank == 1:
            time.sleep(0.2)
            must_raise_mismatch(lambda: dist.all_reduce(torch.ones(8, device=dev)), "rank 1's all_reduce")
        else:
            work = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
            deadline = time.monotonic() + 60
            while not work.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
            _expect(work.is_completed() and "mismatch" in str(work.exception()), work.exception())
            must_raise_mismatch(work.wait, "wait() on a mismatched all_reduce", "numel=4", "numel=8")
        group_still_works()
    check("mismatch_after_peer_started", mismatch_after_peer_started)

    dist.destroy_process_group()
    return check.outcomes


def _scenario_three_ranks(rank: int, port: int) -> dict:
    """all_reduce with 3 ranks: small buffers are exchanged and reduced in rank order by bccl,
    large ones go to gloo's ring; every rank must hold the rank-order result."""
    import torch
    import torch.distributed as dist

    world = 3
    dev = _init(rank, port, world=world)
    check = RankChecks()
    folds = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum}

    def contribution(source, dtype, numel):
        values = torch.randn(numel, generator=torch.Generator().manual_seed(100 + source)) * 4
        return values.to(dtype) if dtype.is_floating_point else values.round().to(dtype)

    def expected(dtype, op, numel):
        contributions = [contribution(source, dtype, numel) for source in range(world)]
        result = contributions[0]
        for other in contributions[1:]:
            result = folds[op](result, other)
        if op == "AVG":
            result = result / world if dtype.is_floating_point else torch.div(result, world, rounding_mode="trunc")
        return result

    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in folds:
            def exchanged(dtype=dtype, op=op):
                x = contribution(rank, dtype, 3000).to(dev)
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                assert torch.equal(x.cpu(), expected(dtype, op, 3000)), f"{x.cpu()} != {expected(dtype, op, 3000)}"
            check(f"three_ranks/{str(dtype)[6:]}/{op}", exchanged)

    def ring():
        # 200,000 float32 elements (800 KB, sent to 2 peers) are past bccl's exchange limit.
        x = contribution(rank, torch.float32, 200_000).to(dev)
        dist.all_reduce(x)
        torch.testing.assert_close(x.cpu(), expected(torch.float32, "SUM", 200_000))
        gathered = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(gathered, x)
        assert all(torch.equal(other, x) for other in gathered), "ranks disagree"
    check("three_ranks/ring", ring)

    def all_gather_into_tensor():
        out = torch.empty(world * 5, device=dev)
        dist.all_gather_into_tensor(out, torch.arange(5.0, device=dev) + 10 * rank)
        assert torch.equal(out.cpu(), torch.cat([torch.arange(5.0) + 10 * r for r in range(world)])), out.cpu()
        out.zero_()[5 * rank:5 * rank + 5] = torch.arange(5.0) + 10 * rank
        dist.all_gather_into_tensor(out, out[5 * rank:5 * rank + 5])  # in place
        assert torch.equal(out.cpu(), torch.cat([torch.arange(5.0) + 10 * r for r in range(world)])), out.cpu()
    check("three_ranks/all_gather_into_tensor", all_gather_into_tensor)

    def reduce_scatter_tensor():
        out = torch.empty(4, dtype=torch.bfloat16, device=dev)
        dist.reduce_scatter_tensor(out, contribution(rank, torch.bfloat16, world * 4).to(dev))
        assert torch.equal(out.cpu(), expected(torch.bfloat16, "SUM", world * 4)[4 * rank:4 * rank + 4]), out.cpu()
    check("three_ranks/reduce_scatter_tensor", reduce_scatter_tensor)

    dist.destroy_process_group()
    return check.outcomes


def _scenario_peer_exits(rank: int, port: int) -> dict:
    """Rank 1 dies (no clean shutdown) while rank 0 waits in a collective."""
    import torch
    import torch.distributed as dist

    dev = _init(rank, port, timeout_s=20)
    x = torch.ones(4, device=dev)
    dist.all_reduce(x)
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    outcome = {"timeout": str(dist.group.WORLD.options._timeout)}
    try:
        dist.all_reduce(x)
        outcome["error"] = None
    except Exception as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["seconds"] = time.monotonic() - start
    return outcome


def _scenario_peer_dies_mid_transfer(rank: int, port: int) -> dict:
    """Rank 1 enters a large all_reduce, then dies; rank 0 is inside gloo when it happens."""
    import torch
    import torch.distributed as dist

    dev = _init(rank, port, timeout_s=20)
    x = torch.ones(16 << 20, device=dev)
    if rank == 1:
        dist.all_reduce(x, async_op=True)
        os._exit(3)
    outcome = {}
    try:
        dist.all_reduce(x)
        dist.all_reduce(x)  # in case the first finished before the peer went away
        outcome["error"] = None
    except Exception as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    return outcome


def _scenario_peer_stalls(rank: int, port: int) -> dict:
    """Rank 1 stays alive but never joins; rank 0 must give up after the group's timeout."""
    import torch
    import torch.distributed as dist

    dev = _init(rank, port, timeout_s=10)
    # The rendezvous store (served by rank 0) says when rank 0 is done: until then rank 1 lives on.
    done = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    if rank == 1:
        done.wait(["peer_stalls/done"])
        os._exit(0)
    start = time.monotonic()
    outcome = {}
    try:
        dist.all_reduce(torch.ones(4, device=dev))
        outcome["error"] = None
    except Exception as error:
        outcome["error"] = f"{type(error).__name__}: {error}"
    outcome["seconds"] = time.monotonic() - start
    done.set("peer_stalls/done", "1")
    return outcome


def _expect(condition, detail):
    if not condition:
        raise AssertionError(str(detail))


def _run_job(scenario: str, limit_s: float = 240, world: int = WORLD) -> list:
    """Start `world` ranks of `scenario`; return each rank's (returncode, outcome dict or None, stderr)."""
    return run_ranks(__file__, scenario, world=world, limit_s=limit_s)


@pytest.fixture(scope="module")
def collectives():
    results = _run_job("collectives")
    outcomes = []
    for rank, (code, outcome, err) in enumerate(results):
        assert code == 0 and outcome is not None, f"rank {rank} failed ({code}):\n{err[-4000:]}"
        outcomes.append(outcome)
    return outcomes


_DTYPES = ("float32", "float16", "bfloat16", "int32", "int64")
_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")
_EMULATOR_CHECKS = [
    "group_type", "default_timeout", "cpu_tensor_rejected", "mismatched_shapes", "wrong_output_size",
    "mismatch_after_peer_started",
]
_CHECKS = [
    "all_reduce/non_contiguous", "all_reduce/matches_gloo", "async/all_reduce", "broadcast", "reduce",
    "all_gather", "all_gather/unequal_sizes", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single/equal", "all_to_all_single/unequal", "gather",
    "scatter", "barrier", "send_recv", "isend_irecv", "batch_isend_irecv", "all_reduce_coalesced",
    "coalescing_manager", "coalesced_tensor_variants", "object_collectives", "subgroups",
]


def _assert_ok(outcomes, name):
    for rank, outcome in enumerate(outcomes):
        assert outcome.get(name) == "ok", f"rank {rank}: {name}: {outcome.get(name)}"


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("op", _OPS)
def test_all_reduce_dtypes_and_ops(collectives, dtype, op):
    _assert_ok(collectives, f"all_reduce/{dtype}/{op}")


@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("op", _OPS)
def test_reduce_scatter_tensor_dtypes_and_ops(collectives, dtype, op):
    _assert_ok(collectives, f"reduce_scatter_tensor/{dtype}/{op}")


@pytest.mark.parametrize("name", _CHECKS)
def test_collective(collectives, name):
    _assert_ok(collectives, name)


@pytest.mark.emulation_only
@pytest.mark.parametrize("name", _EMULATOR_CHECKS)
def test_emulator_behaviour(collectives, name):
    _assert_ok(collectives, name)


def test_every_check_ran(collectives):
    expected = {f"{c}/{d}/{o}" for c in ("all_reduce", "reduce_scatter_tensor") for d in _DTYPES for o in _OPS}
    expected |= set(_CHECKS) | set(_EMULATOR_CHECKS)
    assert set(collectives[0]) == expected


def test_three_ranks():
    results = _run_job("three_ranks", world=3)
    for rank, (code, outcome, err) in enumerate(results):
        assert code == 0 and outcome is not None, f"rank {rank} failed ({code}):\n{err[-4000:]}"
        failed = {name: result for name, result in outcome.items() if result != "ok"}
        assert not failed, f"rank {rank}: {failed}"
        assert len(outcome) == 18, outcome


@pytest.mark.emulation_only
@pytest.mark.slow  # waits for a peer to die or time out
def test_dead_peer_fails_the_survivor():
    (code0, survivor, err0), (code1, _, _) = _run_job("peer_exits", limit_s=120)
    assert code1 == 3
    assert code0 == 0 and survivor is not None, err0[-4000:]
    assert survivor["timeout"] == "0:00:20"  # init_process_group(timeout=...) reaches the group
    assert survivor["error"] and "rank 1" in survivor["error"] and "exited" in survivor["error"], survivor
    assert survivor["error"].startswith("DistBackendError:"), survivor  # what NCCL raises for a lost peer


@pytest.mark.emulation_only
@pytest.mark.slow  # waits for a peer to die or time out
def test_peer_dying_inside_gloo_fails_the_survivor():
    (code0, survivor, err0), (code1, _, _) = _run_job("peer_dies_mid_transfer", limit_s=120)
    assert code1 == 3
    assert code0 == 0 and survivor is not None, err0[-4000:]
    assert survivor["error"], "the survivor's all_reduce completed although its peer died"
    assert survivor["error"].startswith("DistBackendError:"), survivor


@pytest.mark.emulation_only
@pytest.mark.slow  # waits for a peer to die or time out
def test_stalled_peer_times_out():
    (code0, survivor, err0), _ = _run_job("peer_stalls", limit_s=120)
    assert code0 == 0 and survivor is not None, err0[-4000:]
    assert survivor["error"] and "timed out" in survivor["error"], survivor
    assert survivor["error"].startswith("DistBackendError:"), survivor  # NCCL's type for a timeout


if __name__ == "__main__":
    serve_rank(globals())
