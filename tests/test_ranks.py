"""Distributed tests (ranks.py): a body runs in every rank and the next body in the same ranks; a rank
that fails fails the test with its traceback, a rank left waiting is killed, and the ranks are
replaced after either. The tests run in an order that keeps the number of rank starts down."""

import os
import time

import pytest

import ranks
from processes import jobs


def _says_where_it_ran(rank, world, folder):
    import torch.distributed as dist

    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (rank, world, "bccl")
    (folder / f"rank{rank}").write_text(str(os.getpid()))


def _pids(folder) -> list:
    return [int((folder / f"rank{rank}").read_text()) for rank in range(2)]


def _fails_in_rank_one(rank, world):
    assert rank != 1, "rank 1 disagrees"


def _rank_zero_fails_while_rank_one_waits(rank, world):
    assert rank != 0, "rank 0 gives up"
    time.sleep(600)


def _rank_one_exits(rank, world):
    if rank == 1:
        ranks.exit_rank(3)


def _skips(rank, world):
    pytest.skip("nothing to do here")


def test_a_body_runs_in_every_rank_and_the_next_body_in_the_same_ranks(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    ranks.distributed_test()(_says_where_it_ran)(folder=first)
    ranks.distributed_test()(_says_where_it_ran)(folder=second)
    assert len(set(_pids(first))) == 2
    assert _pids(second) == _pids(first)


def test_a_body_that_skips_skips_the_test():
    with pytest.raises(pytest.skip.Exception, match="nothing to do here"):
        ranks.distributed_test()(_skips)()


def test_a_failing_rank_fails_the_test_with_its_traceback_and_the_ranks_are_replaced(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir(), after.mkdir()
    ranks.distributed_test()(_says_where_it_ran)(folder=before)
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 in _fails_in_rank_one: Traceback.*rank 1 disagrees"):
        ranks.distributed_test()(_fails_in_rank_one)()
    ranks.distributed_test()(_says_where_it_ran)(folder=after)
    assert not set(_pids(before)) & set(_pids(after))


def test_a_rank_left_waiting_by_a_failed_peer_is_reported_and_killed(monkeypatch):
    monkeypatch.setattr(ranks, "_AFTER_A_FAILURE_S", 2)
    with pytest.raises(AssertionError, match=r"(?s)rank 0 of 2 .*rank 0 gives up.*rank 1 of 2 .*still running"):
        ranks.distributed_test()(_rank_zero_fails_while_rank_one_waits)()
    assert not ranks._POOLS and not jobs.LIVE_GROUPS


def test_a_rank_ended_on_purpose_passes_and_the_ranks_are_replaced():
    ranks.distributed_test()(_rank_one_exits)()
    assert not ranks._POOLS
