"""The planner on context-parallel jobs: sequence shards whose attention crosses ranks.

The reference is the real job, as for tests/test_plan.py: DeepSpeed's Ulysses sequence parallelism
(deepspeed.sequence.layer.DistributedAttention: all_to_all over the sequence-parallel group around
scaled_dot_product_attention) at SP=2 and 4, and PyTorch's context parallelism
(torch.distributed.tensor.experimental.context_parallel, ring attention, what torchtitan's
--parallelism.context_parallel_degree uses) at CP=2 and 4, its key/value shards rotated by
all_gather and by all_to_all, run as N torchrun processes recorded with SUPA_PLAN_RECORD and
planned for ranks 0 and N-1 in both modes: each played rank's peak allocated and reserved bytes
equal the real rank's to the byte, and its collective lists are equal.
"""

import pytest
from test_plan import MODES, SCRIPTS, plan, real_run

from supa_emu.plan import call_record
from supa_emu.plan.uniform_transport import uniform_sources

ULYSSES = SCRIPTS / "ulysses.py"
RING = SCRIPTS / "ring_attention.py"
ROTATES = ["allgather", "alltoall"]
# name -> (world size, the command): the real job and the plan run the same command.
JOBS = {"ulysses_sp2": (2, [str(ULYSSES), "2"]), "ulysses_sp4": (4, [str(ULYSSES), "4"]),
        "ring_cp2": (2, [str(RING), "2", *ROTATES]), "ring_cp4": (4, [str(RING), "4", *ROTATES])}

pytestmark = pytest.mark.emulation_only


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(job name, mode) -> (the real job's records by rank, the plan of ranks 0 and N-1 in that mode)."""
    real_jobs, plans = {}, {}

    def of(name, mode):
        world, command = JOBS[name]
        if name not in real_jobs:
            real_jobs[name] = real_run(command, world, tmp_path_factory.mktemp(f"{name}-real"))
        if (name, mode) not in plans:
            out = tmp_path_factory.mktemp(f"{name}-{mode}") / "plan.json"
            plans[name, mode] = plan(command, world, out, "--mode", mode)[0]
        return real_jobs[name], plans[name, mode]
    return of


def _assert_same_as_real(name, mode, jobs):
    real, planned = jobs(name, mode)
    world, _ = JOBS[name]
    assert list(planned["ranks"]) == ["0", str(world - 1)]
    for rank, entry in planned["ranks"].items():
        actual = real[int(rank)]
        assert entry["failure"] is None and not entry["failed"], entry["failure"]
        assert entry["peak_allocated"] == actual["peak_allocated"], f"rank {rank}"
        assert entry["peak_reserved"] == actual["peak_reserved"], f"rank {rank}"
        assert entry["collectives"] == actual["collectives"], f"rank {rank}"
        assert [s["name"] for s in entry["sections"]] == [s["name"] for s in actual["sections"]]
        for mine, theirs in zip(entry["sections"], actual["sections"]):
            assert mine["peak_allocated"] == theirs["peak_allocated"], f"rank {rank}, {mine['name']}"
            assert mine["peak_reserved"] == theirs["peak_reserved"], f"rank {rank}, {mine['name']}"
            assert mine["collectives"] == theirs["collectives"], f"rank {rank}, {mine['name']}"
        # Every exchange is uniform (ring attention's permutations too): the only values the plan
        # does not know are the losses rank 0 prints, in shapes mode, which computes none.
        notes = [note["what"] for note in entry["value_dependent"]]
        assert all(what.startswith("aten::_local_scalar_dense") for what in notes), notes
        assert bool(notes) == (mode == "shapes" and rank == "0")
    return planned


def _calls(section: dict) -> dict:
    return {(c["op"], c["group_size"]): c for c in section["collectives"]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ulysses_sp2", "ulysses_sp4"])
def test_planned_ulysses_ranks_match_the_real_job(name, mode, jobs):
    planned = _assert_same_as_real(name, mode, jobs)
    world, _ = JOBS[name]
    (section,) = planned["ranks"]["0"]["sections"]
    # q, k, v and the output, forward and backward: 8 all_to_alls a layer, 2 layers, 2 steps.
    assert _calls(section)[("all_to_all_single", world)]["count"] == 32


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ring_cp2", "ring_cp4"])
def test_planned_ring_attention_ranks_match_the_real_job(name, mode, jobs):
    planned = _assert_same_as_real(name, mode, jobs)
    world, _ = JOBS[name]
    allgather, alltoall = planned["ranks"]["0"]["sections"]
    # The forward's key/value shards travel as the rotate method says; the backward's gradients by all_to_all.
    assert ("all_gather_into_tensor_coalesced", world) in _calls(allgather)
    assert not any(op.startswith("all_gather") for op, _ in _calls(alltoall))
    assert ("all_to_all_single", world) in _calls(allgather) and ("all_to_all_single", world) in _calls(alltoall)


@pytest.mark.slow
def test_a_rank_holds_less_as_the_sequence_is_cut_finer(jobs):
    for sp2, sp4 in (("ulysses_sp2", "ulysses_sp4"), ("ring_cp2", "ring_cp4")):
        assert jobs(sp4, "compute")[0][0]["peak_allocated"] < jobs(sp2, "compute")[0][0]["peak_allocated"]


# ------------------------------------------------------------------------------------------------
# The uniform rule for all_to_all (fast)
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def notes():
    before = dict(call_record._notes)
    yield lambda: {k: v - before.get(k, 0) for k, v in call_record._notes.items() if v != before.get(k, 0)}
    call_record._notes.clear()
    call_record._notes.update(before)


def test_an_even_all_to_all_receives_what_this_rank_sends_itself(notes):
    assert uniform_sources([4, 4, 4, 4], [4, 4, 4, 4], 1, "all_to_all_single") == [1, 1, 1, 1]
    assert notes() == {}


@pytest.mark.parametrize("rank", range(4))
def test_a_ring_permutation_receives_what_this_rank_passes_on(rank, notes):
    # Each rank sends its 6 elements to the next: rank r receives from r - 1 what r sends to r + 1.
    sent = [6 if peer == (rank + 1) % 4 else 0 for peer in range(4)]
    received = [6 if peer == (rank - 1) % 4 else 0 for peer in range(4)]
    sources = uniform_sources(sent, received, rank, "all_to_all_single")
    assert sources[(rank - 1) % 4] == (rank + 1) % 4
    assert notes() == {}


def test_routed_splits_are_flagged_and_take_this_ranks_own_chunk(notes):
    assert uniform_sources([3, 1, 0, 4], [2, 2, 5, 1], 2, "all_to_all_single") == [2, 2, 2, 2]
    assert notes() == {"all_to_all_single with uneven splits: what each rank sends depends on its own data (e.g. "
                       "MoE routing); chunks of another size keep their contents": 1}
