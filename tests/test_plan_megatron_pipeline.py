"""The planner on Megatron-core's pipeline parallelism: every stage played, exact against the real job.

tests/data/plan/megatron_pipeline.py (examples/megatron_core_gpt_at_scale.py's model, optimizer and
data, shrunk) trains with Megatron's 1F1B schedule and its interleaved 1F1B (two virtual stages per
rank) at PP=2 x DP=2, at PP=4 and at PP=2 x TP=2 with sequence parallelism (as Megatron's published
runs), and with `variable_seq_lengths` (an int64 shape sent before each message) at PP=2 x DP=2, as a real
4-process torchrun job recorded with SUPA_PLAN_RECORD and as a plan with `--rank all-stages` in both
modes: every played rank's peak allocated and reserved bytes equal the real rank's to the byte, per
schedule, and its collective and point-to-point lists are equal; the report says which ranks each
played rank stands for (its stage's data or tensor parallel peers): in the real job its TP peers
hold what it holds, its DP peers within one allocator segment. At PP=2 x DP=2 the stages exchange only activations and gradients larger than the planner
carries (as Megatron's do at scale), which no rank waits for: all-stages still plays rank 0's next
stage, rank 2 in Megatron's tp-dp-pp order. At PP=4 and PP=2 x TP=2 the messages are small enough
to carry, and at PP=4 the compute-mode plan logs the real job's losses (with TP the uniform rule's
reductions over the TP ranks are not the real sums, so the losses differ; memory does not depend on
them). Skipped where megatron-core is not installed (it is not in the test extras;
docs/frameworks.md installs it).
"""

import importlib.util
import json
import re

import pytest
from harness import PORT, fresh_process, torchrun_command
from test_plan import MODES, SCRIPTS, plan

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (0.16.1 as docs/frameworks.md installs it)", allow_module_level=True)

MEGATRON_PIPELINE = SCRIPTS / "megatron_pipeline.py"
# name -> (PP, TP, hidden size, sequence length, schedules): 4 ranks each, so DP = 4 / (PP x TP). The
# stages send hidden x sequence / TP bf16 values: 128 KiB at PP=2 x DP=2 (not carried), 4 KiB at PP=4
# and 32 KiB at PP=2 x TP=2 (carried).
JOBS = {"pp2_dp2": (2, 1, 256, 256, ["1f1b", "interleaved", "1f1b_variable"]),
        "pp4": (4, 1, 64, 32, ["1f1b", "interleaved"]),
        "pp2_tp2": (2, 2, 128, 256, ["1f1b", "interleaved"])}
WORLD = 4
SEGMENT = 2 << 20  # the caching allocator's large-pool segment
LARGE_RECV = ("recv: a large float message (activations, gradients) keeps the buffer's contents; memory does not "
              "depend on them")
GATHERED_OBJECT = "all_gather_object: every rank's object is taken to be this rank's"
SKIPPED_KERNEL = "aten::_local_scalar_dense: read values the plan did not compute"

pytestmark = [pytest.mark.emulation_only, pytest.mark.slow]


def _losses(stdout: str) -> list:
    return re.findall(r"^\S+: rank \d+ step \d+ loss \S+$", stdout, re.MULTILINE)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(job name, mode) -> (the real job's records by rank and its losses, the plan and its output)."""
    real_jobs, plans = {}, {}

    def of(name, mode):
        pp, tp, hidden, seq, schedules = JOBS[name]
        command = [str(MEGATRON_PIPELINE), str(pp), str(tp), str(hidden), str(seq), *schedules]
        if name not in real_jobs:
            records = tmp_path_factory.mktemp(f"{name}-real")
            result = fresh_process(torchrun_command(*command, nproc=WORLD, port=PORT),
                                   env={"SUPA_PLAN_RECORD": str(records)}, timeout=900)
            real_jobs[name] = ({rank: json.loads((records / f"rank-{rank}.json").read_text()) for rank in range(WORLD)},
                               _losses(result.stdout))
        if (name, mode) not in plans:
            out = tmp_path_factory.mktemp(f"{name}-{mode}") / "plan.json"
            report, result = plan(command, WORLD, out, "--rank", "all-stages", "--mode", mode)
            plans[name, mode] = report, result.stdout
        return real_jobs[name], plans[name, mode]
    return of


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(JOBS))
def test_every_planned_megatron_stage_matches_the_real_job(name, mode, jobs):
    (real, real_losses), (planned, stdout) = jobs(name, mode)
    pp, tp, _, _, schedules = JOBS[name]
    # Rank 0's pipeline in Megatron's tp-dp-pp order: one rank per stage, TP x DP = WORLD / PP apart,
    # each standing for its stage's TP x DP ranks. Its TP peers hold what it holds, to the byte; its
    # DP peers make the same calls, and keep other shards of the distributed optimizer, which the
    # allocator rounds otherwise: their peaks differ by less than one of its 2 MiB segments.
    per_stage = WORLD // pp
    assert list(planned["ranks"]) == [str(rank) for rank in range(0, WORLD, per_stage)]
    for stage in range(pp):
        first, last = stage * per_stage, (stage + 1) * per_stage - 1
        assert f"rank {first} (stage {stage} of {pp}) stands for ranks {first}{f'-{last}' if last > first else ''}" \
            in stdout.splitlines()
    for rank, entry in planned["ranks"].items():
        assert entry["failure"] is None and not entry["failed"], entry["failure"]
        assert entry["stands_for"] == [[int(rank), int(rank) + per_stage - 1]] and entry["stands_for_why"] is None
        assert entry["stage"] == int(rank) // per_stage
        for stand_in in range(int(rank), int(rank) + per_stage):  # the played rank itself first, then its TP peers
            actual, tp_peer = real[stand_in], stand_in - int(rank) < tp
            assert [s["name"] for s in entry["sections"]] == [s["name"] for s in actual["sections"]] == schedules
            for mine, theirs in zip([entry, *entry["sections"]], [actual, *actual["sections"]]):
                assert mine["collectives"] == theirs["collectives"], f"rank {rank} for rank {stand_in}"
                for key in ("peak_allocated", "peak_reserved"):
                    assert mine[key] == theirs[key] if tp_peer else abs(mine[key] - theirs[key]) <= SEGMENT, \
                        f"rank {rank} for rank {stand_in}, {mine.get('name', 'the job')}: {key}"
        assert {"send", "recv"} <= {c["op"] for c in entry["collectives"]}
        for mine in entry["sections"]:
            if mine["name"] == "1f1b_variable":  # the shapes, carried to the played peer
                assert {("send", "int64"), ("recv", "int64")} <= {(c["op"], c["dtype"]) for c in mine["collectives"]}
        # What the plan could not know, and says: the objects Megatron gathers from the other ranks,
        # the activations and gradients too large to carry (PP=2 only), and in shapes mode the
        # values of kernels it did not run. Nothing else: no recv from a stage it did not play.
        notes = {note["what"] for note in entry["value_dependent"]}
        expected = {GATHERED_OBJECT} | ({LARGE_RECV} if name == "pp2_dp2" else set())
        assert {what for what in notes if not what.startswith(SKIPPED_KERNEL)} == expected, notes
        assert all(not what.startswith(SKIPPED_KERNEL) for what in notes) or mode == "shapes"
    # The stages hold different memory, and the report names the largest with its rank.
    peaks = {int(rank): entry["peak_allocated"] for rank, entry in planned["ranks"].items()}
    assert len(set(peaks.values())) > 1
    largest = planned["largest"]["peak_allocated"]
    assert largest["bytes"] == max(peaks.values()) == peaks[largest["rank"]] and not largest["failed"]
    # The last stage logs the losses. Where every message the stages read is the one the other stage
    # sent (PP=4) and the kernels run (compute mode), they are the real job's.
    planned_losses = _losses(stdout)
    assert len(planned_losses) == len(real_losses) // per_stage == 2 * len(schedules)
    if name == "pp4" and mode == "compute":
        assert planned_losses == real_losses
