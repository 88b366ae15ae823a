"""Ranks of an emulated job share the host's cores: each takes its share of intra-op threads."""

import pytest

from harness import UNTOUCHED, free_port, fresh_process

pytestmark = pytest.mark.emulation_only

NO_LAUNCHER = {"SUPA_EMULATE": "1", "OMP_NUM_THREADS": None, "LOCAL_WORLD_SIZE": None, "LOCAL_SIZE": None}


def _threads() -> int:
    """In a fresh interpreter: torch's intra-op thread count once the emulator activated."""
    import torch

    return torch.get_num_threads()


def threads(**env) -> int:
    return fresh_process(_threads, env={**NO_LAUNCHER, **env}).value


_HOST_THREADS = fresh_process(_threads, env=NO_LAUNCHER, shared=UNTOUCHED)


@pytest.fixture(scope="module")
def host_threads() -> int:
    count = _HOST_THREADS.result().value
    if count < 2:
        pytest.skip("PyTorch uses one thread on this host: there is nothing to share")
    return count


@pytest.mark.slow  # three fresh interpreters each
@pytest.mark.parametrize("variable", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])  # torchrun / the deepspeed launcher
def test_a_rank_takes_its_share_when_the_launcher_says_how_many_run_here(host_threads, variable):
    assert threads(**{variable: "2"}) == host_threads // 2
    assert threads(**{variable: str(host_threads * 4)}) == 1
    assert threads(**{variable: "1"}) == host_threads


def test_the_users_thread_count_wins_over_the_launchers(host_threads):
    assert threads(LOCAL_SIZE="2", OMP_NUM_THREADS=str(host_threads)) == host_threads


def test_a_launcher_count_that_is_not_a_rank_count_is_reported_and_changes_nothing(host_threads):
    result = fresh_process(_threads, env={**NO_LAUNCHER, "LOCAL_SIZE": "two"})
    assert result.value == host_threads
    assert "LOCAL_SIZE='two' is not a rank count" in result.stderr


def _rank(index: int, port: int, chosen: int, host_threads: int, counts) -> None:
    """A rank started by mp.spawn: its thread count at its first bccl group, and after a later one."""
    import torch
    import torch.distributed as dist

    if chosen:
        torch.set_num_threads(chosen)
    dist.init_process_group("bccl", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=2)
    shared = torch.get_num_threads()
    torch.set_num_threads(host_threads)
    dist.new_group([0, 1])  # a later group shares nothing again
    counts.put([chosen, shared, torch.get_num_threads()])
    dist.destroy_process_group()


def _two_jobs_of_two_ranks(host_threads: int) -> list:
    """Without a launcher: one job whose ranks chose no thread count, one whose ranks chose one."""
    import torch.multiprocessing as mp

    counts = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(free_port(), 0, host_threads, counts), nprocs=2)
    mp.spawn(_rank, args=(free_port(), host_threads + 1, host_threads, counts), nprocs=2)
    return sorted(counts.get() for _ in range(4))


@pytest.mark.slow  # two ranks in fresh interpreters
def test_ranks_without_a_launcher_share_the_host_from_their_first_bccl_group(host_threads):
    counts = fresh_process(_two_jobs_of_two_ranks, host_threads, env=NO_LAUNCHER).value
    assert counts == ([[0, host_threads // 2, host_threads]] * 2 + [[host_threads + 1, host_threads + 1, host_threads]] * 2)
