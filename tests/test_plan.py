"""The planner (`python -m supa_emu.plan`): one process plays a rank of an N-card world.

The reference for memory and collectives is the real job: the same script run as N processes by
torchrun, recorded by the same recorder (SUPA_PLAN_RECORD). A planned rank must match the real
rank's peak allocated and peak reserved bytes to the byte and issue the same collectives, in both of
the planner's modes (compute: every kernel runs; shapes: results from PyTorch's shape rules). The
uniform-rank rule itself is checked against plain PyTorch arithmetic.
"""

import json
import pathlib
import re
import sys

import pytest
from harness import PORT, fresh_process, torchrun_command

from supa_emu.plan.__main__ import main as plan_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
GPT = ROOT / "examples" / "train_gpt.py"
CONFIGS = ROOT / "examples" / "configs"
SCRIPTS = pathlib.Path(__file__).resolve().parent / "data" / "plan"  # the scripts planned here, beside the examples
# A model whose parameters and optimizer states show what each ZeRO stage partitions.
GPT_ARGS = ["--vocab", "256", "--seq-len", "16", "--dim", "64", "--layers", "2", "--heads", "4", "--steps", "3",
            "--log-format", "json"]

pytestmark = pytest.mark.emulation_only

# In the order the exactness jobs run them (data/plan/setups.py): the DDP example last, because
# after its destroy_process_group a real bccl job still holds DDP's gradient bucket on the card
# (no Python object refers to it) and would carry it into the next setup, where a plan does not.
CASES = {
    "zero0": [str(GPT), "--config", str(CONFIGS / "zero0.json"), *GPT_ARGS],
    "zero1": [str(GPT), "--config", str(CONFIGS / "zero1.json"), *GPT_ARGS],
    "zero2": [str(GPT), "--config", str(CONFIGS / "zero2.json"), *GPT_ARGS],
    "zero2_offload_optimizer": [str(GPT), "--config", str(CONFIGS / "zero2_offload_optimizer.json"), *GPT_ARGS],
    "zero3": [str(GPT), "--config", str(CONFIGS / "zero3.json"), *GPT_ARGS],
    "zero3_offload_param": [str(GPT), "--config", str(CONFIGS / "zero3_offload_param.json"), *GPT_ARGS],
    "hf_trainer_zero2": [str(ROOT / "examples" / "train_hf_trainer.py"), "--deepspeed-stage", "2", "--steps", "2"],
    "ddp": [str(ROOT / "examples" / "train_cuda_ddp.py"), "--steps", "3"],
}


def real_run(command, world_size, record_dir):
    """The script as a real `world_size`-process torchrun job, each rank recorded to record_dir."""
    fresh_process(torchrun_command(*command, nproc=world_size, port=PORT),
                  env={"SUPA_PLAN_RECORD": str(record_dir)}, timeout=900)
    return {rank: json.loads((record_dir / f"rank-{rank}.json").read_text()) for rank in range(world_size)}


def plan(command, world_size, out, *options, check=True, env=None, timeout=900):
    """The planner's report of `command` (ranks 0 and N-1 unless `options` say otherwise)."""
    result = fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", world_size, "--json", out, *options,
                            "--", *command], env=env, timeout=timeout, check=check)
    return json.loads(out.read_text()) if out.exists() else None, result


# ------------------------------------------------------------------------------------------------
# Exactness against the real job
# ------------------------------------------------------------------------------------------------
MODES = ("compute", "shapes")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(world size, mode) -> (real job's records by rank, plan report in that mode), of every setup
    in one job each."""
    real_jobs, plans = {}, {}

    def of(world_size, mode="compute"):
        if world_size not in real_jobs:
            directory = tmp_path_factory.mktemp(f"world{world_size}")
            # Every setup in one job, each in a section of its own (see the script).
            command = [str(SCRIPTS / "setups.py"), json.dumps([[name, *args] for name, args in CASES.items()])]
            real_jobs[world_size] = command, real_run(command, world_size, directory / "real")
        command, real = real_jobs[world_size]
        if (world_size, mode) not in plans:
            out = tmp_path_factory.mktemp(f"plan{world_size}-{mode}") / "plan.json"
            plans[world_size, mode] = plan(command, world_size, out, "--mode", mode)[0]
        return real, plans[world_size, mode]
    return of


def _section(record, name):
    (figures,) = [s for s in record["sections"] if s["name"] == name]
    return figures


def _assert_same_as_real(case, world_size, mode, jobs):
    real, report = jobs(world_size, mode)
    assert report["world_size"] == world_size and report["mode"] == mode
    assert sorted(report["ranks"]) == sorted({"0", str(world_size - 1)})
    for rank, planned in report["ranks"].items():
        actual = real[int(rank)]
        assert planned["failure"] is None, planned["failure"]
        assert [s["name"] for s in planned["sections"]] == [s["name"] for s in actual["sections"]] == list(CASES)
        mine, theirs = _section(planned, case), _section(actual, case)
        assert mine["peak_allocated"] == theirs["peak_allocated"], f"rank {rank}"
        assert mine["peak_reserved"] == theirs["peak_reserved"], f"rank {rank}"
        assert mine["collectives"] == theirs["collectives"], f"rank {rank}"
        assert mine["peak_allocated"] > 0 and mine["collectives"]
        # The whole job's figures too (the largest setup's peak, every setup's calls).
        assert planned["peak_allocated"] == actual["peak_allocated"], f"rank {rank}"
        assert planned["peak_reserved"] == actual["peak_reserved"], f"rank {rank}"
        assert planned["collectives"] == actual["collectives"], f"rank {rank}"
        if mode == "shapes":  # and where the peak was, as compute mode says
            assert planned["peak_phase"] == jobs(world_size)[1]["ranks"][rank]["peak_phase"], f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["zero2", "zero3", "ddp"])
def test_planned_rank_matches_the_real_two_rank_job(case, mode, jobs):
    _assert_same_as_real(case, 2, mode, jobs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["zero0", "zero1", "zero3_offload_param", "zero2_offload_optimizer",
                                  "hf_trainer_zero2"])
def test_planned_rank_matches_the_real_two_rank_job_more_setups(case, mode, jobs):
    _assert_same_as_real(case, 2, mode, jobs)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_planned_rank_matches_the_real_four_rank_job(case, mode, jobs):
    _assert_same_as_real(case, 4, mode, jobs)


# ------------------------------------------------------------------------------------------------
# The uniform-rank rule
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_collectives_answer_as_if_every_rank_held_this_ranks_data(tmp_path):
    world = 4
    report, _ = plan([str(SCRIPTS / "collectives.py"), str(tmp_path / "out")], world, tmp_path / "plan.json")
    for rank in (0, world - 1):
        out = json.loads((tmp_path / f"out.{rank}").read_text())
        local = [float(i + rank) for i in range(4)]
        assert (out["rank"], out["world"], out["backend"]) == (rank, world, "bccl")
        assert out["sum"] == [v * world for v in local]
        assert out["avg"] == local and out["max"] == local
        assert out["premul_sum"] == [v * 0.5 * world for v in local]
        assert out["all_gather_into_tensor"] == local * world
        assert out["reduce_scatter_tensor"] == [float(rank * world)]
        assert out["all_gather"] == [local] * world
        # Small broadcasts carry the root's value, taken from rank 0 (played first): as in a real job.
        assert out["broadcast"] == [0.0, 1.0, 2.0, 3.0]
        assert out["subgroup_sum"] == [v * 2 for v in local]
        calls = {(c["op"], c["group_size"]): c for c in report["ranks"][str(rank)]["collectives"]}
        assert calls[("all_reduce", world)]["count"] == 4 and calls[("all_reduce", world)]["bytes"] == 16
        assert calls[("all_gather_into_tensor", world)]["bytes"] == 16 * world
        assert calls[("reduce_scatter_tensor", world)]["bytes"] == 4 * world
        assert calls[("all_reduce", 2)]["count"] == 1
        assert calls[("barrier", world)]["bytes"] == 0
        # Sections: each one's own calls, and its peak over what was allocated on entry.
        subgroup, scratch = report["ranks"][str(rank)]["sections"]
        assert subgroup["name"] == "subgroup" and scratch["name"] == "scratch"
        assert subgroup["collectives"] == [{"op": "all_reduce", "group_size": 2, "dtype": "float32", "bytes": 16,
                                            "count": 1}]
        assert scratch["collectives"] == []
        assert scratch["peak_allocated"] == out["scratch_peak"] > 1 << 20


@pytest.mark.slow
def test_shapes_mode_moves_small_payloads_and_leaves_large_ones(tmp_path):
    # Small calls, which programs branch on, answer by the uniform rule in both modes; in shapes mode a
    # payload above 64 KiB is not moved (its outputs keep their contents), with the same calls and figures.
    world, reports, outs = 4, {}, {}
    for mode in MODES:
        reports[mode], _ = plan([str(SCRIPTS / "payload.py"), str(tmp_path / mode)], world,
                                tmp_path / f"{mode}.json", "--mode", mode)
        outs[mode] = json.loads((tmp_path / f"{mode}.{world - 1}").read_text())
    assert outs["compute"] == {"flag": [4.0] * 4, "big": [4.0, 4.0], "gathered": [4.0, 4.0]}
    assert outs["shapes"] == {"flag": [4.0] * 4, "big": [1.0, 1.0], "gathered": [0.0, 0.0]}
    for key in ("collectives", "peak_allocated", "peak_reserved"):
        assert reports["shapes"]["ranks"][str(world - 1)][key] == reports["compute"]["ranks"][str(world - 1)][key]


@pytest.mark.slow
def test_a_profiled_planned_rank_names_each_collective_by_its_op(tmp_path):
    # The trace of a planned rank names its collectives as a real rank's does (c10d's names).
    plan([str(SCRIPTS / "profiled.py"), str(tmp_path / "names")], 2, tmp_path / "plan.json", "--rank", "0")
    assert json.loads((tmp_path / "names.0").read_text()) == sorted([
        "bccl:all_reduce", "bccl:broadcast", "bccl:_allgather_base", "bccl:_reduce_scatter_base", "bccl:barrier"])


@pytest.mark.slow
def test_a_device_bound_world_splits_into_uniform_subgroups(tmp_path):
    # init_process_group(device_id=...) binds the world, and DeviceMesh then splits it: in a planned
    # world the split needs no other rank's post (a real bccl split waits for all of them).
    report, _ = plan([str(SCRIPTS / "bound_mesh.py"), str(tmp_path / "out")], 4, tmp_path / "plan.json")
    for rank in (0, 3):
        out = json.loads((tmp_path / f"out.{rank}").read_text())
        assert out["tp_size"] == 2 and out["tp_sum"] == [2.0 * (rank + 1)] * 3
        assert out["splits"] == 2  # the mesh's two dimensions
        calls = {(c["op"], c["group_size"]) for c in report["ranks"][str(rank)]["collectives"]}
        assert ("all_reduce", 2) in calls


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_an_out_of_memory_rank_is_a_result_with_the_failed_allocation(tmp_path, mode):
    script = SCRIPTS / "out_of_memory.py"
    report, result = plan([str(script)], 2, tmp_path / "plan.json", "--mode", mode, check=False,
                          env={"SUPA_EMU_MEMORY": "64MiB"})
    assert result.returncode == 1
    for rank in ("0", "1"):
        entry = report["ranks"][rank]
        assert entry["oom"] and entry["capacity"] == 64 << 20
        (event,) = entry["oom_events"]
        # Sizes as the allocator counts them: 40 MiB is a whole number of its 512-byte blocks, and its
        # segment is the request rounded to 2 MiB, so nothing is added.
        assert event["requested_bytes"] == event["allocated"] == 40 << 20
        assert event["phase"] == "unknown" and event["location"] == f"{script}:8 (<module>)"
        assert "OutOfMemoryError" in entry["failure"]["error"]
    assert (f"rank 1: out of memory asking for 40 MiB in unknown at {script}:8 (<module>), with 40 MiB allocated, "
            f"40 MiB reserved of 64 MiB") in result.stdout


@pytest.mark.slow
def test_a_failing_rank_is_reported_and_the_others_still_run(tmp_path):
    report, result = plan([str(SCRIPTS / "fails_last.py")], 3, tmp_path / "plan.json", check=False)
    assert result.returncode == 1
    assert report["ranks"]["0"]["failure"] is None
    failure = report["ranks"]["2"]["failure"]
    assert failure["error"] == "ValueError: the last rank has no data"
    assert "fails_last.py" in failure["traceback"]
    assert "rank 2 failed: ValueError: the last rank has no data" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script, message", [
    ("no_process_group.py", "never initialises a process group"),
    ("spawns_ranks.py", "spawns its own ranks"),
])
def test_scripts_a_planned_world_cannot_run_fail_with_one_line(tmp_path, script, message):
    # A limit far below the default: a script the planner cannot run must fail at once, not hang.
    report, result = plan([str(SCRIPTS / script)], 2, tmp_path / "plan.json", "--rank", "0", check=False,
                          timeout=180)
    assert result.returncode == 1
    assert message in report["ranks"]["0"]["failure"]["error"]


@pytest.mark.slow
def test_a_model_built_on_host_tensors_beyond_the_host_fails_with_how_to_avoid_it(tmp_path):
    report, result = plan([str(SCRIPTS / "host_model.py")], 2, tmp_path / "plan.json", "--rank", "0", "--mode", "shapes", check=False,
                          env={"SUPA_PLAN_HOST_MEMORY": "600MiB"}, timeout=180)
    assert result.returncode == 1
    error = report["ranks"]["0"]["failure"]["error"]
    # The third 256 MiB weight is refused (the first two and what torch itself holds are below 600 MiB).
    assert re.match(r"RuntimeError: planner: the script holds 5\d\d\.\d\d MiB in host \(CPU\) tensors and asks for "
                    r"256\.00 MiB more, beyond the 600\.00 MiB of host memory a planned rank may use", error), error
    assert "deepspeed.zero.Init()" in error and "to_empty(device=...)" in error


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "AVG", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_uniform_reduction_is_the_reduction_of_n_equal_copies(op, size):
    import functools
    import torch
    import torch.distributed as dist
    from supa_emu.plan.uniform_transport import reduce_uniform

    local = torch.tensor([1, -2, 3, 0, 7], dtype=torch.int64)
    copies = [local.clone() for _ in range(size)]
    combine = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
               "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
    if op == "AVG":
        expected = torch.div(functools.reduce(torch.add, copies), size, rounding_mode="trunc")
    else:
        expected = functools.reduce(combine[op], copies)
    result = local.clone()
    reduce_uniform(result, getattr(dist.ReduceOp.RedOpType, op), size)
    assert torch.equal(result, expected)


def test_plan_record_names_a_directory(tmp_path, monkeypatch):
    from supa_emu import config

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SUPA_PLAN_RECORD", str(tmp_path / "a_file"))
    with pytest.raises(config.ConfigError, match="SUPA_PLAN_RECORD=.* is a file"):
        config.load()
    monkeypatch.setenv("SUPA_PLAN_RECORD", str(tmp_path / "records"))
    assert config.load().plan_record == tmp_path / "records"


# ------------------------------------------------------------------------------------------------
# The command's arguments (fast)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0", "--", str(GPT)], "--world-size 0: a world has at least 1 rank"),
    (["--world-size", "4", "--rank", "4", "--", str(GPT)], "--rank 4 is outside the world of 4 ranks (0 to 3)"),
    (["--world-size", "4", "--rank", "-1", "--", str(GPT)], "--rank -1 is outside the world of 4 ranks"),
    (["--world-size", "4", "--plot", "out.png", "--", str(GPT)], "needs matplotlib"),
    (["--world-size", "4", "--", "no/such/script.py"], "no/such/script.py: no such script"),
    (["--world-size", "4"], "no script"),
    (["--world-size", "4", "--", "-m", "no_such_module_here"], "-m no_such_module_here: no module named"),
    (["--world-size", "4", "--", "-m"], "-m needs a module name"),
    (["--world-size", "4", "--mode", "fast", "--", str(GPT)], "--mode fast: accepted values: compute, shapes"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_plot_draws_each_rank_and_the_capacity(tmp_path):
    from supa_emu.plan import plot

    rank = {"peak_allocated": 3 << 20, "peak_reserved": 4 << 20, "peak_phase": "forward", "oom": False,
            "failure": None, "collectives": [], "timeline": [[0, 0.0, 0, 0], [1, 0.5, 3 << 20, 4 << 20], [2, 0.7, 1 << 20, 4 << 20]]}
    report = {"world_size": 8, "script": "train.py", "capacity": 5 << 20, "ranks": {"0": rank, "7": rank}}
    chart = plot.svg(report)
    assert chart.count("<polyline") == 4
    assert "capacity 5 MiB" in chart and "rank 7: peak 3 MiB allocated (forward)" in chart
    plot.write(report, str(tmp_path / "plan.html"))
    assert "<svg" in (tmp_path / "plan.html").read_text()
    far = dict(report, capacity=64 << 30)
    assert "above the chart" in plot.svg(far)


@pytest.mark.slow
def test_a_module_runs_as_python_m_runs_it_and_the_peak_names_its_frame(tmp_path):
    package = SCRIPTS / "planned_pkg"
    out = tmp_path / "argv"
    result = fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", "2", "--json",
                            tmp_path / "plan.json", "--", "-m", "planned_pkg.train", str(out)],
                           cwd=SCRIPTS, timeout=900)
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["script"] == "-m planned_pkg.train" and "plan of -m planned_pkg.train" in result.stdout
    for rank in ("0", "1"):
        argv, name = eval((tmp_path / f"argv.{rank}").read_text())
        assert argv == [str(package / "train.py"), str(out)] and name == "__main__"
        entry = report["ranks"][rank]
        assert entry["peak_location"] == f"{package / 'train.py'}:9 (fill_the_card)"
        assert entry["peak_phase"] == "unknown"  # the main thread, outside any training step


@pytest.mark.slow
def test_a_planned_fsdp2_tp_rank_matches_the_real_four_rank_job(tmp_path):
    script = SCRIPTS / "fsdp_tp.py"
    real = real_run([str(script)], 4, tmp_path / "real")
    compute, _ = plan([str(script)], 4, tmp_path / "plan.json")
    shapes, _ = plan([str(script)], 4, tmp_path / "plan-shapes.json", "--mode", "shapes")
    for rank, planned in [*compute["ranks"].items(), *shapes["ranks"].items()]:
        actual = real[int(rank)]
        assert planned["failure"] is None, planned["failure"]
        assert planned["peak_allocated"] == actual["peak_allocated"] > 0, f"rank {rank}"
        assert planned["peak_reserved"] == actual["peak_reserved"], f"rank {rank}"
        assert planned["collectives"] == actual["collectives"], f"rank {rank}"
        assert {c["op"] for c in planned["collectives"]} >= {"reduce_scatter_tensor", "all_gather_into_tensor"}


@pytest.mark.slow
@pytest.mark.parametrize("world_backend", ["bccl", "gloo"])
def test_gloo_groups_follow_the_uniform_rule(tmp_path, world_backend):
    world = 4
    report, _ = plan([str(SCRIPTS / "gloo_groups.py"), str(tmp_path / "out"), world_backend], world,
                     tmp_path / "plan.json")
    for rank in (0, world - 1):
        out = json.loads((tmp_path / f"out.{rank}").read_text())
        local = [float(i + rank) for i in range(4)]
        assert (out["world_backend"], out["cpu_backend"]) == (world_backend, "gloo")
        assert out["sum"] == [v * world for v in local] and out["max"] == local
        assert out["all_gather"] == [[float(rank)] * 2] * world
        assert out["objects"] == [{"rank": rank}] * world
        assert out["broadcast_object"] == "from rank 0"  # the root's value, from rank 0 played first
        # Checked and described as any group's call (the c10d face's), with the gloo backend's name.
        assert out["supa_tensor"].startswith("gloo: tensors must be cpu and dense"), out["supa_tensor"]
        assert out["profiled"] == ["gloo:all_reduce"]
        entry = report["ranks"][str(rank)]
        assert entry["failure"] is None, entry["failure"]
        # As in a recorded real run, host (gloo) groups add nothing to the card's collectives.
        assert all(c["op"] != "all_reduce" or c["dtype"] != "float32" for c in entry["collectives"])
