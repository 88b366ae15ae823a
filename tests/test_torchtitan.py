"""torchtitan's own debug model as its configuration has it (flex attention under torch.compile,
selective activation checkpointing) with the model compiled too (`--compile.enable`), on 2 cards:
the planner's rank equals the real 2-process job, recorded by the same recorder (SUPA_PLAN_RECORD),
to the byte in both modes. docs/frameworks.md shows the commands; torchtitan 0.3.0 and triton are
installed beside torch 2.13 as it says, the test is skipped where they are not.
"""

import importlib.util
import json
import os
import pathlib
import sys

import pytest
from harness import PORT, fresh_process, torchrun_command

# Found, not imported: importing torchtitan costs seconds and imports triton.
for _package in ("torchtitan", "triton", "tokenizers"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"needs {_package} (torchtitan 0.3.0 as docs/frameworks.md installs it)", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODES = ("compute", "shapes")

pytestmark = [pytest.mark.emulation_only, pytest.mark.slow]


def _tokenizer_and_data(directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A word-level tokenizer of this repository's README and the README's paragraphs as a JSON-lines
    data set: torchtitan's wheel ships neither its test tokenizer nor its test data."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    paragraphs = [p for p in (ROOT / "README.md").read_text().split("\n\n") if p.strip()]
    data = directory / "data"
    data.mkdir()
    (data / "data.json").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(paragraphs, trainers.WordLevelTrainer(vocab_size=512, special_tokens=special))
    assets = directory / "tokenizer"
    assets.mkdir()
    tokenizer.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(json.dumps({"bos_token": special[0], "eos_token": special[1]}))
    return assets, data


def test_debug_model_with_flex_attention_compile_and_selective_ac_plans_as_the_real_job(tmp_path):
    assets, data = _tokenizer_and_data(tmp_path)
    train = ["-m", "torchtitan.train", "--module", "torchtitan_supa", "--config", "llama3_debugmodel",
             "--hf-assets-path", str(assets), "--dataloader.dataset", "c4_test", "--dataloader.dataset-path", str(data),
             "--dump-folder", str(tmp_path / "outputs"), "--training.steps", "2", "--training.seq-len", "64",
             "--training.local-batch-size", "2", "--compile.enable"]
    # The configuration module is an example; one Inductor cache for the three runs, the real job's
    # compiling first (a cache another checkout filled may hold code of another emulator).
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "examples"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    records = tmp_path / "real"
    fresh_process(torchrun_command(*train, nproc=2, port=PORT), env={**env, "SUPA_PLAN_RECORD": str(records)},
                  timeout=1200)
    real = {rank: json.loads((records / f"rank-{rank}.json").read_text()) for rank in range(2)}
    for mode in MODES:
        out = tmp_path / f"{mode}.json"
        fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", "2", "--mode", mode, "--no-time",
                       "--json", out, "--", *train], env=env, timeout=1200)
        planned = json.loads(out.read_text())["ranks"]
        assert sorted(planned) == ["0", "1"], mode
        for rank, figures in planned.items():
            actual = real[int(rank)]
            assert figures["failure"] is None, (mode, rank, figures["failure"])
            for figure in ("peak_allocated", "peak_reserved", "collectives"):
                assert figures[figure] == actual[figure], (mode, rank, figure)
            assert figures["peak_allocated"] > 0 and figures["collectives"]
            assert figures["no_shape_rule"] == [], (mode, rank)
