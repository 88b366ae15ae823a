"""PyTorch's own distributed test base on emulated cards: torch's `_DistTestBase` with
BACKEND=nccl under transfer_to_supa ('nccl' is bccl, 'cuda' the emulated cards), world size 2.

The reference is the same base on gloo with CPU tensors and the emulator off, recorded in
torch_distributed_gloo.json by `SUPA_EMULATE=0 python tests/torch_distributed_driver.py
--backend gloo --write-gloo-table` (it involves nothing of this project, so its outcomes change
only with torch, whose version the table records). What must hold on the emulated cards:
- no test fails, except those listed in torch_distributed_expectations.AWAITING (pieces still
  being built; each must fail until its piece lands, then leave the table);
- a test skips only for a reason the base itself gives for NCCL on any machine
  (BASE_SKIP_REASONS), or because it is in EXPECTED_SKIPS (it needs what a CPU host or
  transfer_to_supa cannot give) and is not run at all;
- so every test that passes on gloo passes here, or is one the base does not run on NCCL
  (CPU-tensor tests), and then its `_cuda` twin passes here unless the base skips that for NCCL
  too (world size, sparse tensors).
The fast tier runs REPRESENTATIVE; the whole base is `slow` (CI).
"""

import json
import re

import pytest
from harness import fresh_process

import torch_distributed_expectations as expectations
import torch_distributed_driver
from torch_distributed_driver import GLOO_TABLE

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")


def _run_base(tmp_path, names=()) -> dict:
    out = tmp_path / "outcomes.json"
    argv = ["--backend", "nccl", "--out", str(out), *names]
    # The driver's own process (not pytest's): torch's base reads BACKEND & co. at import, and the
    # ranks are forked from a process that has not touched a card. A new one (fresh=True): the
    # driver sets BRTB_ENABLE_DTYPE_DEMOTION before it imports torch, whose activation reads it.
    result = fresh_process(torch_distributed_driver.main, argv, env={"SUPA_EMULATE": "1", "SUPA_EMU_TRANSFER": "1"},
                           timeout=3600, check=False, torch_first=False)
    if not out.exists():
        raise AssertionError(f"the driver wrote no outcomes ({result.returncode}):\n{result.stdout}\n{result.stderr[-20000:]}")
    outcomes = json.loads(out.read_text())
    summary = [line for line in result.stdout.splitlines() if line.startswith("torch distributed base")]
    print(*summary, sep="\n")
    return outcomes


def _base_skip(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern in expectations.BASE_SKIP_REASONS)


def _problems(outcomes: dict) -> list:
    problems = []
    for name, record in sorted(outcomes.items()):
        outcome, detail = record["outcome"], record["detail"]
        if name in expectations.AWAITING:
            if outcome == "pass":
                problems.append(f"{name} passes now: remove it from AWAITING ({expectations.AWAITING[name]})")
            continue
        if outcome in ("fail", "error"):
            problems.append(f"{name} {outcome}s:\n{detail}")
        elif outcome == "skip" and not _base_skip(detail):
            problems.append(f"{name} skipped for a reason the base does not give for NCCL everywhere: {detail!r}")
    return problems


def test_tables_are_consistent():
    import torch

    gloo = json.loads(GLOO_TABLE.read_text())
    assert gloo["torch"] == torch.__version__, (
        f"{GLOO_TABLE.name} was recorded with torch {gloo['torch']}, this is {torch.__version__}: "
        f"regenerate it with `{gloo['command']}`")
    assert not gloo["failed"], gloo["failed"]
    overlap = set(expectations.EXPECTED_SKIPS) & set(expectations.AWAITING)
    assert not overlap, overlap
    assert not set(expectations.REPRESENTATIVE) & (set(expectations.EXPECTED_SKIPS) | set(expectations.AWAITING))
    for table in (expectations.EXPECTED_SKIPS, expectations.AWAITING):
        assert all(reason.strip() for reason in table.values())


@pytest.fixture(scope="module")
def base_outcomes(request, tmp_path_factory):
    """The driver's outcomes: of the whole base when this run includes test_whole_base (the
    representative tests are among them), else of the representative tests only."""
    whole = any(item.name == "test_whole_base" and item.module is request.module for item in request.session.items)
    tmp_path = tmp_path_factory.mktemp("distributed-base")
    if not whole:
        return _run_base(tmp_path, expectations.REPRESENTATIVE)
    names = [name for name in _all_test_names(tmp_path) if name not in expectations.EXPECTED_SKIPS]
    outcomes = _run_base(tmp_path, names)
    assert sorted(outcomes) == sorted(names)
    return outcomes


@pytest.mark.emulation_only
def test_representative_subset_passes(base_outcomes):
    assert set(expectations.REPRESENTATIVE) <= set(base_outcomes)
    failed = {name: base_outcomes[name] for name in expectations.REPRESENTATIVE
              if base_outcomes[name]["outcome"] != "pass"}
    assert not failed, json.dumps(failed, indent=1)


@pytest.mark.slow
@pytest.mark.emulation_only
def test_whole_base(base_outcomes):
    outcomes = base_outcomes
    problems = _problems(outcomes)
    gloo_passed = json.loads(GLOO_TABLE.read_text())["passed"]
    for name in gloo_passed:
        record = outcomes.get(name)
        if record is None:
            if name not in expectations.EXPECTED_SKIPS:
                problems.append(f"{name} passes on gloo but is missing here")
            continue
        twin = outcomes.get(f"{name}_cuda")
        if record["outcome"] == "skip" and twin is not None and f"{name}_cuda" not in expectations.AWAITING:
            if twin["outcome"] != "pass" and not (twin["outcome"] == "skip" and _base_skip(twin["detail"])):
                problems.append(f"{name} passes on gloo, is skipped for NCCL by the base, and its twin "
                                f"{name}_cuda neither passes nor is skipped by the base: {twin['detail']!r}")
    assert not problems, "\n\n".join(problems)


def _base_test_names() -> list:
    """In a fresh interpreter: the names of the base's tests, as configured for NCCL."""
    torch_distributed_driver.configure("nccl")
    return torch_distributed_driver.test_names()


def _all_test_names(tmp_path) -> list:
    return fresh_process(_base_test_names, env={"SUPA_EMULATE": "1"}).value
