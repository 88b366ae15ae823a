"""The planner on pipeline-parallel jobs: point-to-point messages between played ranks, every stage played.

The reference is the real job, as for tests/test_plan.py: torch.distributed.pipelining's schedules
(GPipe, 1F1B, interleaved 1F1B with two virtual stages per rank) at PP=2 and 4, PP=2 x DP=2 with
"pp" the outermost mesh dimension, and DeepSpeed's PipelineModule at PP=2, run as N torchrun processes recorded with SUPA_PLAN_RECORD
and planned with `--rank all-stages` in both modes: each played rank's peak allocated and reserved
bytes equal the real rank's to the byte, and its collective and point-to-point lists are equal.
"""

import json
import pathlib
import re

import pytest
from test_plan import MODES, SCRIPTS, plan, real_run

from supa_emu.plan import plot, report, stages
from supa_emu.plan.__main__ import main as plan_main
from supa_emu.plan.__main__ import parse

PIPELINE = SCRIPTS / "pipeline.py"
EXCHANGE = SCRIPTS / "p2p_exchange.py"
DEEPSPEED_PIPELINE = SCRIPTS / "deepspeed_pipeline.py"
SCHEDULES = ["gpipe", "1f1b", "interleaved"]
# name -> (world size, data-parallel degree, schedules): the real job and the plan run them all in one job.
JOBS = {"pp2": (2, 1, SCHEDULES), "pp4": (4, 1, SCHEDULES), "pp2_dp2": (4, 2, ["1f1b"])}

pytestmark = pytest.mark.emulation_only


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(job name, mode) -> (the real job's records by rank, the plan of every stage in that mode)."""
    real_jobs, plans = {}, {}

    def of(name, mode):
        world, dp, schedules = JOBS[name]
        command = [str(PIPELINE), str(dp), *schedules]
        if name not in real_jobs:
            real_jobs[name] = real_run(command, world, tmp_path_factory.mktemp(f"{name}-real"))
        if (name, mode) not in plans:
            out = tmp_path_factory.mktemp(f"{name}-{mode}") / "plan.json"
            plans[name, mode] = plan(command, world, out, "--rank", "all-stages", "--mode", mode)[0]
        return real_jobs[name], plans[name, mode]
    return of


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(JOBS))
def test_every_planned_stage_matches_the_real_job(name, mode, jobs):
    real, planned = jobs(name, mode)
    world, dp, schedules = JOBS[name]
    # all-stages plays rank 0's pipeline: one rank per stage, DP apart ("pp" is the outer dimension).
    assert list(planned["ranks"]) == [str(rank) for rank in range(0, world, dp)]
    for rank, entry in planned["ranks"].items():
        actual = real[int(rank)]
        _assert_same_as_real(rank, entry, actual)
        assert entry["value_dependent"] == []  # every message the stages read came from the stage that sent it
        assert [s["name"] for s in entry["sections"]] == [s["name"] for s in actual["sections"]] == schedules
        for mine, theirs in zip(entry["sections"], actual["sections"]):
            assert mine["peak_allocated"] == theirs["peak_allocated"], f"rank {rank}, {mine['name']}"
            assert mine["peak_reserved"] == theirs["peak_reserved"], f"rank {rank}, {mine['name']}"
            assert mine["collectives"] == theirs["collectives"], f"rank {rank}, {mine['name']}"
    # The stages hold different memory, and the report names the largest with its rank.
    peaks = {int(rank): entry["peak_allocated"] for rank, entry in planned["ranks"].items()}
    assert len(set(peaks.values())) > 1
    largest = planned["largest"]["peak_allocated"]
    assert largest["bytes"] == max(peaks.values()) == peaks[largest["rank"]] and not largest["failed"]


def _assert_same_as_real(rank: str, entry: dict, actual: dict) -> None:
    assert entry["failure"] is None and not entry["failed"], entry["failure"]
    assert entry["peak_allocated"] == actual["peak_allocated"], f"rank {rank}"
    assert entry["peak_reserved"] == actual["peak_reserved"], f"rank {rank}"
    assert entry["collectives"] == actual["collectives"], f"rank {rank}"
    assert {"send", "recv"} <= {c["op"] for c in entry["collectives"]}


@pytest.fixture(scope="module")
def deepspeed_job(tmp_path_factory):
    return real_run([str(DEEPSPEED_PIPELINE)], 2, tmp_path_factory.mktemp("deepspeed-real"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_planned_deepspeed_pipeline_module_matches_the_real_job(mode, deepspeed_job, tmp_path):
    planned, _ = plan([str(DEEPSPEED_PIPELINE)], 2, tmp_path / "plan.json", "--rank", "all-stages", "--mode", mode)
    assert list(planned["ranks"]) == ["0", "1"]
    for rank, entry in planned["ranks"].items():
        _assert_same_as_real(rank, entry, deepspeed_job[int(rank)])
    # The last stage broadcasts the loss: rank 0, played first, does not know it, and says so.
    assert [note["what"] for note in planned["ranks"]["0"]["value_dependent"]] == [
        "broadcast: the root's value is not known (its rank was not played first); this rank's own value stands in"]


@pytest.mark.slow
def test_a_recv_of_sizes_from_an_unplayed_stage_fails_the_plan_at_its_call_site(tmp_path):
    # Rank 0 alone: pipelining's first message from stage 1 (the warm-up vote's result, int32) cannot
    # be known. The plan says where, instead of reading left-over card memory as a size.
    planned, result = plan([str(PIPELINE), "1", "1f1b"], 2, tmp_path / "plan.json", "--rank", "0", check=False,
                           timeout=300)
    assert result.returncode == 1
    assert list(planned["ranks"]) == ["0"]
    entry = planned["ranks"]["0"]
    assert re.fullmatch(
        r"PlanError: planner: rank 0 receives int32 data \(sizes or a pickled object\) from rank 1, which this plan "
        r"does not play, at .*pipeline\.py:\d+ \(train\), in .*/torch/distributed/pipelining/stage\.py:\d+ "
        r"\(_warmup_backward_result\): its content cannot be known; play the sender too \(--rank with a list, or "
        r"--rank all-stages\)", entry["failure"]["error"]), entry["failure"]["error"]
    assert entry["failed"] and entry["peak_allocated"] < 100 << 20  # nothing allocated from junk sizes
    assert re.search(r"\n +0 .* FAILED: figures up to the failure\n", result.stdout)


@pytest.mark.slow
def test_a_played_receiver_gets_what_its_played_sender_sent(tmp_path):
    # Ranks 1 and 3 over a subgroup (its group ranks are not the global ones), two tags.
    planned, _ = plan([str(EXCHANGE), str(tmp_path / "out"), "values"], 4, tmp_path / "plan.json", "--rank", "1,3")
    assert list(planned["ranks"]) == ["0", "1", "3"]
    received = json.loads((tmp_path / "out.3").read_text())
    assert received["sizes_sum"] == 2 * sum(range(100_000))  # sizes: exact, however large (rank 1's values x 2)
    assert received["small"] == [1.0] * 4  # a small float message: rank 1's
    assert received["large"] == [3.0, 3.0]  # a large one keeps the buffer (memory does not depend on it) ...
    assert [note["what"] for note in planned["ranks"]["3"]["value_dependent"]] == [  # ... and says so
        "recv: a large float message (activations, gradients) keeps the buffer's contents; memory does not "
        "depend on them"]
    sent = {(c["op"], c["dtype"], c["bytes"]) for c in planned["ranks"]["1"]["collectives"]}
    assert sent == {("send", "int64", 800_000), ("send", "float32", 16), ("send", "float32", 1 << 20)}


@pytest.mark.slow
@pytest.mark.parametrize("case, error", [
    ("crossed", r"rank (0|1) waits at .*p2p_exchange\.py:\d+ \(<module>\) for a message from rank (0|1) \(.*\) while "
                r"every played rank waits for another: the program's sends and receives do not match"),
    ("silent", r"rank 0 waits at .*p2p_exchange\.py:\d+ \(<module>\) for a message from rank 1 \(.*\), which ended "
               r"without sending it"),
], ids=["crossed", "silent"])
def test_receives_no_played_rank_will_send_fail_instead_of_waiting(tmp_path, case, error):
    planned, result = plan([str(EXCHANGE), str(tmp_path / "out"), case], 2, tmp_path / "plan.json", "--rank",
                           "all-stages", check=False, timeout=300)
    assert result.returncode == 1
    failed = [rank for rank, entry in planned["ranks"].items() if entry["failed"]]
    assert failed == (["0", "1"] if case == "crossed" else ["0"])
    for rank in failed:
        assert re.fullmatch(f"PlanError: planner: {error}", planned["ranks"][rank]["failure"]["error"])


# ------------------------------------------------------------------------------------------------
# The command and its reports (fast)
# ------------------------------------------------------------------------------------------------
def test_rank_takes_lists_and_all_stages():
    assert parse(["--world-size", "8", "--rank", "4,2", "--rank", "7", "--", str(PIPELINE)]).ranks == [0, 2, 4, 7]
    args = parse(["--world-size", "8", "--rank", "all-stages", "--", str(PIPELINE)])
    assert (args.ranks, args.all_stages) == ([0], True)
    args = parse(["--world-size", "8", "--", str(PIPELINE)])
    assert (args.ranks, args.all_stages) == ([0, 7], False)


@pytest.mark.parametrize("value", ["x", "1,,2", "all"])
def test_a_bad_rank_is_a_one_line_error(value, capsys):
    assert plan_main(["--world-size", "4", "--rank", value, "--", str(PIPELINE)]) == 2
    err = capsys.readouterr().err
    assert f"--rank {value}: accepted a rank, a list of ranks (0,4) or all-stages" in err and err.count("\n") == 1


def _record(peak: int, failure=None) -> dict:
    return {"capacity": 1 << 30, "peak_allocated": peak, "peak_reserved": peak + 4096, "peak_phase": "forward",
            "oom": False, "oom_events": [], "collectives": [], "value_dependent": [], "timeline": [[0, 0.0, peak, peak]],
            "failure": failure}


def test_every_report_marks_a_failed_rank_and_names_the_largest(tmp_path):
    failure = {"error": "PlanError: planner: ...", "traceback": None}
    full = report.build(4, 4, "train.py", [], {0: _record(5 << 20), 2: _record(9 << 20, failure), 3: _record(7 << 20)},
                        "compute")
    assert [r["failed"] for r in full["ranks"].values()] == [False, True, False]
    assert full["largest"] == {"peak_allocated": {"rank": 2, "bytes": 9 << 20, "failed": True},
                               "peak_reserved": {"rank": 2, "bytes": (9 << 20) + 4096, "failed": True}}
    table = report.text(full).splitlines()
    assert table[3].startswith("    2") and table[3].endswith("FAILED: figures up to the failure")
    assert table[2].endswith("to the end") and table[4].endswith("to the end")
    assert table[5] == "largest: 9 MiB allocated on rank 2 (FAILED), 9 MiB reserved on rank 2 (FAILED)"
    assert "rank 2: peak 9 MiB allocated (forward), 9 MiB reserved, FAILED: figures up to the failure" in plot.svg(full)
    plot.write(full, str(tmp_path / "plan.html"))
    rows = pathlib.Path(tmp_path / "plan.html").read_text().split("<tr>")[2:]
    assert ["FAILED: figures up to the failure" in row for row in rows] == [False, True, False]


def test_all_stages_says_which_ranks_each_played_rank_stands_for():
    # Megatron's tp-dp-pp order at TP 2 x PP 2 (rank 0's pipeline: 0 and 2; TP groups 0-1 and 2-3; the
    # model-parallel group spans both stages and holds both played ranks).
    tp_pp = {0: [[0, 1, 2, 3], [0, 1], [0, 2], [0]], 2: [[0, 1, 2, 3], [2, 3], [0, 2], [2]]}
    assert stages.stand_ins(4, tp_pp) == {0: {"stage": 0, "stands_for": [[0, 1]], "why": None},
                                          2: {"stage": 1, "stands_for": [[2, 3]], "why": None}}
    # "pp" innermost (stride 1): stage i is every rank r with r % PP == i.
    innermost = stages.stand_ins(32, {0: [list(range(0, 32, 2))], 1: [list(range(1, 32, 2))]})[1]
    assert innermost["stands_for"] == [[r, r] for r in range(1, 32, 2)]  # runs of one rank each
    assert stages.describe(1, 1, 2, innermost["stands_for"], None) == \
        "rank 1 (stage 1 of 2) stands for ranks 1, 3, 5, 7, 9, 11, 13, 15, ... (16 ranks)"
    # At scale: 768 cards, TP 8 x DP 48 x PP 2 (the 70B row): rank 384 stands for the second half.
    assert stages.stand_ins(768, {0: [list(range(8))], 384: [list(range(384, 392))]})[384]["stands_for"] == \
        [[384, 767]]
    # A group that crosses stages without a played rank, or played ranks that are not one pipeline of a
    # mesh: not derived, and said.
    crossing = stages.stand_ins(4, {0: [[0, 3]], 2: [[2]]})
    assert crossing[0] == {"stage": None, "stands_for": [[0, 0]],
                           "why": "rank 0's group of ranks 0, 3 holds ranks of other stages (ranks 3)"}
    assert stages.stand_ins(8, {0: [], 3: []})[3]["why"] == \
        "2 stages 3 ranks apart do not divide the world of 8 ranks into pipelines"
    records = {0: dict(_record(5 << 20), groups=tp_pp[0]), 2: dict(_record(7 << 20), groups=tp_pp[2])}
    full = report.build(4, 4, "train.py", [], records, "compute", all_stages=True)
    assert "groups" not in full["ranks"]["0"] and full["ranks"]["2"]["stands_for"] == [[2, 3]]
    lines = report.text(full).splitlines()
    assert lines[5:7] == ["rank 0 (stage 0 of 2) stands for ranks 0-1", "rank 2 (stage 1 of 2) stands for ranks 2-3"]
    listed = report.build(4, 4, "train.py", [], {0: _record(5 << 20), 3: _record(7 << 20)}, "compute")
    assert "stands_for" not in listed["ranks"]["3"] and "stands for" not in report.text(listed)
