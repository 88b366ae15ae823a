"""Ranks of an emulated job share the host's cores: each takes its share of intra-op threads."""

import pytest

from harness import UNTOUCHED, free_port, run_python, shared_case

pytestmark = pytest.mark.emulation_only

PRINT_THREADS = "import torch; print(torch.get_num_threads())"
NO_LAUNCHER = {"SUPA_EMULATE": "1", "OMP_NUM_THREADS": None, "LOCAL_WORLD_SIZE": None, "LOCAL_SIZE": None}


def threads(**env) -> int:
    return int(run_python(PRINT_THREADS, env={**NO_LAUNCHER, **env}).stdout.split()[-1])


_HOST_THREADS = shared_case("test_core_share: threads without a launcher", PRINT_THREADS, env=NO_LAUNCHER,
                            stage=UNTOUCHED)


@pytest.fixture(scope="module")
def host_threads() -> int:
    count = int(_HOST_THREADS.result().stdout.split()[-1])
    if count < 2:
        pytest.skip("PyTorch uses one thread on this host: there is nothing to share")
    return count


@pytest.mark.parametrize("variable", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])  # torchrun / the deepspeed launcher
def test_a_rank_takes_its_share_when_the_launcher_says_how_many_run_here(host_threads, variable):
    assert threads(**{variable: "2"}) == host_threads // 2
    assert threads(**{variable: str(host_threads * 4)}) == 1
    assert threads(**{variable: "1"}) == host_threads


def test_the_users_thread_count_wins_over_the_launchers(host_threads):
    assert threads(LOCAL_SIZE="2", OMP_NUM_THREADS=str(host_threads)) == host_threads


def test_a_launcher_count_that_is_not_a_rank_count_is_reported_and_changes_nothing(host_threads):
    result = run_python(PRINT_THREADS, env={**NO_LAUNCHER, "LOCAL_SIZE": "two"})
    assert int(result.stdout.split()[-1]) == host_threads
    assert "LOCAL_SIZE='two' is not a rank count" in result.stderr


@pytest.mark.slow  # two ranks in fresh interpreters
def test_ranks_without_a_launcher_share_the_host_from_their_first_bccl_group(host_threads):
    out = run_python(f"""
        import os, torch, torch.distributed as dist, torch.multiprocessing as mp

        def rank(index, port, chosen):
            if chosen:
                torch.set_num_threads(chosen)
            dist.init_process_group("bccl", init_method=f"tcp://127.0.0.1:{{port}}", rank=index, world_size=2)
            shared = torch.get_num_threads()
            torch.set_num_threads({host_threads})
            dist.new_group([0, 1])  # a later group shares nothing again
            line = f"threads {{chosen}} {{shared}} {{torch.get_num_threads()}}\\n"
            os.write(1, line.encode())  # one write: the two ranks' lines do not interleave
            dist.destroy_process_group()

        if __name__ == "__main__":
            mp.spawn(rank, args=({free_port()}, 0), nprocs=2)
            mp.spawn(rank, args=({free_port()}, {host_threads + 1}), nprocs=2)
    """, env=NO_LAUNCHER).stdout
    counts = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("threads"))
    assert counts == ([["0", str(host_threads // 2), str(host_threads)]] * 2
                      + [[str(host_threads + 1), str(host_threads + 1), str(host_threads)]] * 2)
