"""torchtitan 0.3.0's pipeline parallelism on emulated cards, and its plan with `--rank all-stages`.

torchtitan's trainer hands torch's schedules microbatches already split, which torch 2.13's
`Schedule.step` does not take; `examples/torchtitan_supa.py`'s trainer drives the same schedule the
way torch 2.13 takes it (the whole batch and its target). Its Llama debug model (SDPA) trains with
1F1B at PP=2 and with interleaved 1F1B at PP=2 x TP=2, and its DeepSeek-V3 debug model as torchtitan
configures it (MoE, compiled flex attention, whose mask_mod captures ints that are symbolic in the
stages' graphs) with 1F1B at PP=2 (the real torchrun job: the loss falls); the plan of every stage
equals the recorded real job to the byte in both modes (docs/planner.md, "Pipeline parallelism").
Skipped where torchtitan is not installed.
"""

import json
import os
import re
import sys

import pytest
from harness import PORT, fresh_process, torchrun_command
from test_torchtitan import MODES, ROOT, _tokenizer_and_data

# name -> (cards, torchtitan_supa's config, torchtitan's options for the job, and for the real job alone)
JOBS = {
    "1f1b_pp2": (2, "llama3_debugmodel_sdpa", ["--parallelism.pipeline-parallel-schedule", "1F1B"], []),
    "interleaved_pp2_tp2": (4, "llama3_debugmodel_sdpa", ["--parallelism.pipeline-parallel-schedule", "Interleaved1F1B",
                                                          "--parallelism.tensor-parallel-degree", "2"], []),
    # The real job's router forced to the balanced routing the plan assumes (--moe-routing's default).
    "deepseek_v3_flex_pp2": (2, "deepseek_v3_debugmodel", [], ["--debug.moe-force-load-balance"]),
}
LOSS = re.compile(r"step: +\d+ +\S*?loss: +(-?[\d.]+)")  # the log colours its fields

pytestmark = [pytest.mark.emulation_only, pytest.mark.slow]


@pytest.mark.parametrize("name", list(JOBS))
def test_torchtitan_pipeline_trains_and_every_stage_plans_as_the_real_job(tmp_path, name):
    cards, config, options, real_options = JOBS[name]
    assets, data = _tokenizer_and_data(tmp_path)
    train = ["-m", "torchtitan.train", "--module", "torchtitan_supa", "--config", config,
             "--hf-assets-path", str(assets), "--dataloader.dataset", "c4_test", "--dataloader.dataset-path", str(data),
             "--dump-folder", str(tmp_path / "outputs"), "--training.steps", "4", "--training.seq-len", "64",
             "--training.local-batch-size", "4", "--training.disable-cuda-graphs",
             "--parallelism.pipeline-parallel-degree", "2", *options]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # Each run compiles into an empty Inductor cache of its own, as a job's first run does: what a
    # compile leaves on the card differs from what code loaded from the cache leaves (1,024 bytes at
    # the DeepSeek-V3 debug model's peak, in the real job and in its plan alike).
    records = tmp_path / "real"
    real_env = {**env, "SUPA_PLAN_RECORD": str(records), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "real-inductor")}
    job = fresh_process(torchrun_command(*train, *real_options, nproc=cards, port=PORT), env=real_env, timeout=1200)
    # The last stage's ranks log the loss (the others log -1, torchtitan's "not here").
    losses = [float(x) for x in LOSS.findall(job.stdout + job.stderr) if float(x) >= 0]
    assert len(losses) == 4 * (cards // 2), losses
    assert losses[-1] < losses[0], losses  # it trains: step 4's loss below step 1's
    real = {rank: json.loads((records / f"rank-{rank}.json").read_text()) for rank in range(cards)}
    for mode in MODES:
        out = tmp_path / f"{mode}.json"
        fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", str(cards), "--rank", "all-stages",
                       "--mode", mode, "--no-time", "--json", out, "--", *train],
                      env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"{mode}-inductor")}, timeout=1200)
        planned = json.loads(out.read_text())
        # "pp" is torchtitan's outermost mesh dimension: rank 0's pipeline is ranks 0 and cards / 2.
        assert list(planned["ranks"]) == ["0", str(cards // 2)], mode
        for rank, figures in planned["ranks"].items():
            actual = real[int(rank)]
            assert figures["failure"] is None and not figures["failed"], (mode, rank, figures["failure"])
            for figure in ("peak_allocated", "peak_reserved", "collectives"):
                assert figures[figure] == actual[figure], (mode, rank, figure)
            assert {"send", "recv"} <= {c["op"] for c in figures["collectives"]}, (mode, rank)
            assert figures["no_shape_rule"] == [], (mode, rank)
            if mode == "compute":  # every message a stage read is the one the other stage sent
                assert figures["value_dependent"] == [], (mode, rank)
        peaks = {int(rank): figures["peak_allocated"] for rank, figures in planned["ranks"].items()}
        assert len(set(peaks.values())) == 2  # the stages hold different memory ...
        largest = planned["largest"]["peak_allocated"]
        assert largest["bytes"] == max(peaks.values()) == peaks[largest["rank"]]  # ... and the largest is named
