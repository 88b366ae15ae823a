"""The memory checker (`SUPA_EMU_SANITIZE=memory`, `torch.supa._memcheck`): what a card faults on
raises here before a byte is touched, reads of memory nothing wrote are reported with the
allocation's stack, and correct programs (training steps, compiled code, DeepSpeed ZeRO-3, the
OpInfo database) run without a single report."""

import json
import pathlib
import re
import sys
import warnings

import pytest

import harness
import script_sequence
from harness import fresh_process, torchrun_command
from ranks import distributed_test
import torch

from supa_emu import config

pytestmark = pytest.mark.emulation_only

_memcheck = torch.supa._memcheck
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def checker():
    _memcheck.enable_memory_checker()
    try:
        yield _memcheck.memory_checker
    finally:
        _memcheck.disable_memory_checker()


@pytest.fixture
def strict():
    _memcheck.enable_memory_checker(strict=True)
    try:
        yield _memcheck.memory_checker
    finally:
        _memcheck.disable_memory_checker()


def _line_of(text: str) -> int:
    """The line of this file holding `text` (for checking reported stacks)."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


# ---- bounds and liveness -------------------------------------------------------------------------

def test_a_view_past_its_shrunk_storage_raises_before_the_op_runs(checker):
    t = torch.arange(8.0, device="supa")
    v = t[4:]
    t.untyped_storage().resize_(16)  # the view now reaches 16 bytes past the allocation
    with pytest.raises(_memcheck.IllegalAddressError) as caught:
        v.sum()
    text = str(caught.value)
    assert "illegal address: aten::sum reads argument 'self' (shape [4]" in text
    assert "at bytes [16, 32) of its storage" in text and "live allocation of 16 bytes" in text
    assert f'line {_line_of("        v.sum()")}' in text  # the stack of the access
    assert isinstance(caught.value, torch.AcceleratorError)  # as CUDA reports an illegal address
    with pytest.raises(_memcheck.IllegalAddressError, match=r"aten::fill_ writes argument 'self'"):
        v.fill_(7.0)
    assert t[:4].tolist() == [0.0, 1.0, 2.0, 3.0]  # the write was refused before it happened


def test_a_storage_freed_under_a_view_raises_on_next_use(checker):
    t = torch.ones(4, device="supa")
    v = t[1:]
    t.untyped_storage().resize_(0)
    with pytest.raises(_memcheck.IllegalAddressError, match=r"storage holds no memory: it was freed or resized to 0"):
        v.sum()
    with pytest.raises(_memcheck.IllegalAddressError, match=r"aten::_to_copy reads argument 'self'"):
        v.cpu()
    with pytest.raises(_memcheck.IllegalAddressError, match=r"aten::copy_ writes argument 'self'"):
        v.copy_(torch.zeros(3))
    # A storage grown back (ZeRO-3's gather) is usable again.
    t.untyped_storage().resize_(16)
    v.fill_(2.0)
    assert v.sum().item() == 6.0


def _use_after_free() -> None:
    t = torch.ones(1 << 20, device="supa")
    v = t[10:]
    t.untyped_storage().resize_(0)
    with pytest.raises(_memcheck.IllegalAddressError, match="^SUPA memory checker: illegal address: aten::sum"):
        v.sum()


def test_a_use_after_free_is_an_error_not_a_crash():
    fresh_process(_use_after_free, env={"SUPA_EMU_SANITIZE": "memory"})


def test_operands_of_every_kind_are_checked(checker):
    """Written outputs (out=), lists of tensors (foreach) and kwargs count as operands."""
    a = torch.ones(4, device="supa")
    out = torch.empty(8, device="supa")
    view = out[4:]
    out.untyped_storage().resize_(16)
    with pytest.raises(_memcheck.IllegalAddressError, match=r"aten::add writes argument 'out'"):
        torch.add(a, a, out=view)
    with pytest.raises(_memcheck.IllegalAddressError, match=r"reads argument 'self\[1\]'"):
        torch._foreach_add([a, view], 1.0)


def test_correct_views_and_shared_storages_pass(checker):
    t = torch.arange(12.0, device="supa").reshape(3, 4)
    assert t.t()[1:, ::2].sum().item() == (1 + 9 + 2 + 10 + 3 + 11)
    assert t.as_strided((2, 2), (4, 1), 6).sum().item() == 6 + 7 + 10 + 11
    empty_view = t[3:]  # zero elements past the end reach nothing
    assert empty_view.sum().item() == 0.0
    storage_view = torch.empty(0, device="supa").set_(t.untyped_storage(), 8, (4,))
    assert storage_view.tolist() == [8.0, 9.0, 10.0, 11.0]


# ---- initcheck -----------------------------------------------------------------------------------

def _allocate_uninitialised():
    return torch.empty(8, device="supa")


def test_reading_never_written_memory_warns_once_per_allocation_site(checker):
    e, other = [_allocate_uninitialised() for _ in range(2)]
    e[:4].fill_(1.0)
    assert e[:4].sum().item() == 4.0  # only written bytes: silent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e.sum()
        e.sum()
        other.sum()  # another block, the same site
    assert [w.category for w in caught] == [_memcheck.UninitializedReadWarning]
    text = str(caught[0].message)
    assert "uninitialized read: aten::sum reads argument 'self' (shape [8]" in text and "byte 16" in text
    site = text.split("Allocation site:")[1].split("Stack of this access:")[0]
    assert f'line {_line_of("return torch.empty(8")}, in _allocate_uninitialised' in site
    assert caught[0].filename == __file__  # attributed to the reading line, not the checker


def test_strict_mode_raises_on_an_uninitialised_read(strict):
    e = torch.empty(4, 4, device="supa")
    with pytest.raises(_memcheck.UninitializedReadError, match=r"aten::_to_copy reads argument 'self'"):
        e.cpu()
    e.zero_()
    assert e.cpu().sum().item() == 0.0


def test_memory_written_by_ops_copies_and_fills_is_initialised(strict):
    a = torch.empty(6, device="supa")
    a.copy_(torch.arange(6.0))  # a copy from the host
    b = torch.empty_like(a)
    torch.mul(a, 2, out=b)  # an out= result
    c = torch.empty(2, 6, device="supa")
    c[0] = a  # rows written one at a time
    c[1].fill_(1.0)
    d = torch.empty(3, 4, device="supa")
    d[0].zero_()
    d[2].zero_()
    assert d[::2].sum().item() == 0.0  # only rows 0 and 2: their hull holds row 1, never read
    assert (b.sum() + c.sum()).item() == 30.0 + 15.0 + 6.0
    with pytest.raises(_memcheck.UninitializedReadError, match=r"byte 16 of the allocation"):
        d.sum()  # row 1 was never written


def test_a_storage_grown_by_set_reports_its_new_bytes(strict):
    t = torch.arange(4.0, device="supa")
    s = torch.empty(0, device="supa")
    s.set_(t.untyped_storage(), 10, (4,))  # grows the storage to 14 floats, as on CUDA
    assert t.untyped_storage().nbytes() == 56
    with pytest.raises(_memcheck.UninitializedReadError, match=r"byte 40 of the allocation"):
        s.sum()
    assert t.sum().item() == 6.0  # the kept prefix stays written


def test_a_graph_capture_reads_nothing_yet(strict):
    """A capture only records kernels on a card: a static input filled before replay is fine."""
    static = torch.empty(4, device="supa")
    graph = torch.supa.SUPAGraph()
    with torch.supa.graph(graph):
        out = static * 2
    static.copy_(torch.arange(4.0))
    graph.replay()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(_memcheck.IllegalAddressError):  # bounds are still checked while capturing
        view = static[2:]
        static.untyped_storage().resize_(8)
        with torch.supa.graph(torch.supa.SUPAGraph()):
            view * 2


@distributed_test(world=1, env={"SUPA_EMU_SANITIZE": "memory-strict"})
def test_collective_outputs_count_as_written(rank, world):
    import torch.distributed as dist

    out = torch.empty(4, device="supa")
    dist.all_gather_into_tensor(out, torch.arange(4.0, device="supa"))
    assert out.sum().item() == 6.0  # strict: a read of unwritten memory would raise


@pytest.mark.skipif(torch.supa.device_count() < 2, reason="needs two SUPA devices")
def test_single_process_collective_outputs_count_as_written(strict):
    # torch.supa.bccl copies between cards natively, outside any operator.
    inputs = [torch.full((4,), float(i + 1), device=f"supa:{i}") for i in range(2)]
    outputs = [torch.empty(8, device=f"supa:{i}") for i in range(2)]
    torch.supa.bccl.all_gather(inputs, outputs)
    reduced = [torch.empty(4, device=f"supa:{i}") for i in range(2)]
    torch.supa.bccl.all_reduce(inputs, reduced)
    assert [o.sum().item() for o in outputs] == [12.0, 12.0]
    assert [r.sum().item() for r in reduced] == [12.0, 12.0]


# ---- no false reports ----------------------------------------------------------------------------

def test_a_training_step_is_silent(strict):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)).to("supa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("supa")
    x, y = torch.randn(8, 16, device="supa"), torch.randint(0, 4, (8,), device="supa")
    with warnings.catch_warnings():
        warnings.simplefilter("error", _memcheck.UninitializedReadWarning)
        for _ in range(3):
            with torch.autocast("supa", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert torch.isfinite(loss).item()


def test_compiled_code_is_silent(strict):
    def f(a, b):
        return torch.nn.functional.silu(a @ b).sum(dim=0)

    compiled = torch.compile(f, backend="inductor")
    a, b = torch.randn(8, 8, device="supa"), torch.randn(8, 8, device="supa")
    torch.testing.assert_close(compiled(a, b).cpu(), f(a.cpu(), b.cpu()))


@pytest.mark.slow
def test_opinfo_under_the_checker_is_silent():
    """A slice of the OpInfo run (every op whose name starts with one of these letters)."""
    command = [sys.executable, "-m", "pytest", str(ROOT / "tests" / "test_opinfo.py"), "-q", "-x", "-n", "0",
               "-p", "no:cacheprovider",
               "-k", "test_op_matches_cpu and (abs or add or cat or index or matmul or mean or softmax or where)"]
    # strict: a report fails the op's test
    result = harness.fresh_process(command, env={"SUPA_EMU_SANITIZE": "memory-strict"}, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= 40, result.stdout[-2000:]


DEEPSPEED_CONFIGS = ["zero3.json", "zero3_offload_param.json", "zero2_offload_optimizer.json", "bf16.json"]


@pytest.fixture(scope="module")
def deepspeed_jobs():
    """(the job, config -> its run's output): examples/train_gpt.py with each config, one after the
    other in one strict-checked 2-rank job (each rank is this file: see the end)."""
    from test_deepspeed_training import GPTConfig, example_command

    model = GPTConfig(vocab=256, seq_len=16, dim=128, layers=2, heads=4)  # a few steps of it check > 500 operators
    scripts = [[name, *map(str, example_command(name, "--steps", 2, model=model))] for name in DEEPSPEED_CONFIGS]
    job = harness.fresh_process(torchrun_command(__file__, json.dumps(scripts), nproc=2, port=harness.PORT),
                                env={"SUPA_EMU_SANITIZE": "memory-strict"}, timeout=900, check=False)
    return job, script_sequence.outputs(job, DEEPSPEED_CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("config_name", DEEPSPEED_CONFIGS)
def test_deepspeed_jobs_are_silent(deepspeed_jobs, config_name):
    job, runs = deepspeed_jobs
    assert runs[config_name].returncode == 0, job.stderr[-4000:]
    assert "SUPA memory checker" not in job.stderr, job.stderr[-4000:]
    # Searched, not matched at line starts: another rank's print() may have left a line unended.
    counts = [int(n) for n in re.findall(rf"memory checker: {re.escape(config_name)} operators checked: (\d+)",
                                         job.stderr)]
    assert len(counts) == 2 and min(counts) > 500, job.stderr[-4000:]  # both ranks, the whole run


# ---- the switch ----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, expected", [("memory", "memory"), ("memory-strict", "memory-strict"),
                                             ("streams,memory", "streams,memory"),
                                             (" Memory , streams-report ", "streams-report,memory"), ("off", "off")])
def test_sanitize_modes_combine(monkeypatch, value, expected):
    monkeypatch.setenv("SUPA_EMU_SANITIZE", value)
    assert config.load().sanitize == expected


@pytest.mark.parametrize("value", ["heap", "memory,memory-strict", "streams,streams-report", "off,memory"])
def test_bad_sanitize_values_name_the_accepted_ones(monkeypatch, value):
    monkeypatch.setenv("SUPA_EMU_SANITIZE", value)
    with pytest.raises(config.ConfigError, match=r"SUPA_EMU_SANITIZE=.*accepted values: off, streams, streams-report, "
                                                  r"memory, memory-strict, or one stream and one memory mode"):
        config.load()


def _both_checkers_report() -> None:
    from supa_emu.supa import _sanitizer_switch

    t = torch.ones(4, device="supa")
    v = t[2:]
    t.untyped_storage().resize_(4)
    with pytest.raises(_memcheck.IllegalAddressError):
        v.sum()
    side = torch.supa.Stream()
    with torch.supa.stream(side):  # written on the side stream, read on the default one unordered
        y = torch.zeros(8, device="supa")
    with pytest.raises(torch.supa._sanitizer.StreamRaceError):
        y.mul(2)
    assert len(_sanitizer_switch.active().tools) == 2


def test_streams_and_memory_run_together():
    fresh_process(_both_checkers_report, env={"SUPA_EMU_SANITIZE": "streams,memory"})


def test_off_by_default_nothing_is_imported_or_changed():
    # Code, not a function of this file: importing this file imports the checker.
    result = fresh_process("""
        import sys, torch
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        t = torch.ones(8, device="supa")
        v = t[2:]
        t.untyped_storage().resize_(16)
        print(v[:2].sum().item())  # inside the shrunk storage: fine either way
        torch.empty(4, device="supa").sum()
        print(sorted(m for m in sys.modules if "memcheck" in m), _get_current_dispatch_mode_stack(),
              torch.supa._native()._memcheck_tracked_blocks())
    """, env={"SUPA_EMU_SANITIZE": None})
    assert result.stdout.split("\n")[:2] == ["2.0", "[] [] 0"], result


if __name__ == "__main__":  # a torchrun rank of deepspeed_jobs: the scripts in turn, each followed by its count
    import contextlib

    @contextlib.contextmanager
    def _counted(name):
        before = _memcheck.memory_checker.checked
        try:
            yield
        finally:
            # One write per rank: print() writes its parts separately, and the ranks share the stderr pipe.
            harness.print_line(f"memory checker: {name} operators checked: {_memcheck.memory_checker.checked - before}",
                               sys.stderr)

    script_sequence.run(json.loads(sys.argv[1]), around=_counted)
