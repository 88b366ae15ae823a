"""Hugging Face Trainer and accelerate on SUPA cards, with no device-specific code in the script.

Runs examples/train_hf_trainer.py (a tiny Llama built from a config, synthetic tokens) in fresh
processes: one process on one card, on the CPU as the reference, with bf16, and with DeepSpeed
ZeRO-2 on two cards under torchrun and under the deepspeed launcher. The Trainer finds the card
through torch.cuda, which transfer_to_supa points at SUPA.
"""

import importlib.util
import json
import pathlib
import sys

import pytest
import torch

import harness
from harness import deepspeed_command, torchrun_command

# Found, not imported: the examples import them in their own processes, and importing them here
# would cost every pytest process that collects this file most of a second.
for _package in ("transformers", "accelerate"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"needs {_package}", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_hf_trainer.py"
FP32 = dict(rtol=1e-5, atol=1e-6)

pytestmark = pytest.mark.skipif(
    not (hasattr(torch, "supa") and torch.supa.is_available() and torch.cuda.is_available()),
    reason="needs SUPA cards with transfer_to_supa applied (real, or emulated with SUPA_EMULATE=1)")

# With more than one visible card, a single Trainer process would use torch.nn.DataParallel over
# all of them (as on a CUDA machine); one visible card keeps the 1-process runs on supa:0.
ONE_CARD = {"SUPA_VISIBLE_DEVICES": "0"}



def run(*args, launcher=None, env=None, quiet=False):
    """Runs the example and returns its result line (printed by rank 0); `quiet`: and checks that
    nothing was printed to stderr (no warning)."""
    example = [EXAMPLE, *args]
    env = {"BRTB_TRANSFER_SILENCE": "1", **(env or {})}
    if launcher == "torchrun":
        result = harness.fresh_process(torchrun_command(*example, nproc=2, port=harness.PORT), env=env, timeout=900)
    elif launcher == "deepspeed":
        result = harness.fresh_process(deepspeed_command(*example, num_gpus=2, port=harness.PORT), env=env, timeout=900)
    else:
        result = harness.fresh_process([sys.executable, *example], env=env, timeout=900)
    assert not (quiet and result.stderr), result.stderr[-6000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"event"')]
    assert len(lines) == 1, result.stdout
    return lines[0]


@pytest.fixture(scope="module")
def cpu_reference():
    return run("--cpu", env=ONE_CARD)


@pytest.mark.slow  # several fresh interpreters doing real work
def test_trainer_trains_on_the_card_with_the_cpu_losses(cpu_reference):
    on_card = run(env=ONE_CARD)
    assert on_card["parameter_devices"] == ["supa:0"]
    assert cpu_reference["parameter_devices"] == ["cpu"]
    assert len(on_card["losses"]) == 4
    torch.testing.assert_close(on_card["losses"], cpu_reference["losses"], **FP32)
    assert on_card["losses"][-1] < on_card["losses"][0]


@pytest.mark.slow  # several fresh interpreters doing real work
def test_trainer_bf16_runs_on_the_card(cpu_reference):
    bf16 = run("--bf16", env=ONE_CARD)
    assert bf16["parameter_devices"] == ["supa:0"]
    # bf16 autocast rounds activations to 8 mantissa bits; the run still follows the fp32 one.
    torch.testing.assert_close(bf16["losses"], cpu_reference["losses"], rtol=0, atol=2e-2)


@pytest.mark.slow  # several fresh interpreters doing real work
def test_trainer_with_two_visible_cards_uses_data_parallel_quietly(cpu_reference):
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    result = run(env={"SUPA_VISIBLE_DEVICES": "0,1"}, quiet=True)
    assert result["n_gpu"] == 2 and result["world_size"] == 1  # one process, torch.nn.DataParallel
    assert result["parameter_devices"] == ["supa:0"]
    # Each step splits the global batch over the cards; bccl sums the replicas' gradients.
    torch.testing.assert_close(result["losses"], cpu_reference["losses"], **FP32)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_trainer_with_deepspeed_zero2_on_two_cards(launcher, cpu_reference):
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    result = run("--deepspeed-stage", 2, launcher=launcher)
    assert result["world_size"] == 2 and result["backend"] == "bccl"
    assert result["parameter_devices"] == ["supa:0"]
    assert result["deepspeed_accelerator"] == "supa_deepspeed.accelerator.supa_accelerator.SUPA_Accelerator"
    # The whole data set is the global batch: the 2-rank run sees what the 1-process run sees.
    torch.testing.assert_close(result["losses"], cpu_reference["losses"], **FP32)
