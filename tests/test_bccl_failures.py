"""The bccl backend when a call goes wrong: refused calls (the emulator's errors, and the group stays
usable), calls that do not match across ranks, and a peer that dies or stalls (the survivor fails with
NCCL's error type instead of hanging). The collectives that succeed: test_bccl.py.

Each test body runs in every rank (ranks.distributed_test: rank r on supa:r, a bccl default group).
"""

import datetime
import time

import pytest
from ranks import distributed_test, exit_rank, rank_store
import torch
import torch.distributed as dist

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """`actual` stayed on this rank's card and holds exactly `expected`."""
    assert actual.device == torch.device("supa", dist.get_rank()), f"result moved to {actual.device}"
    assert torch.equal(actual.cpu(), expected), f"{actual.cpu()} != {expected}"


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
