"""The stream-race sanitizer (torch.supa._sanitizer): racy snippets are reported with the right
streams and stacks; the same snippets, correctly synchronised, are silent."""

import datetime
import gc
import json
import logging
import pathlib

import pytest

import harness
from harness import PORT, fresh_process, torchrun_command
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

pytestmark = pytest.mark.emulation_only

from supa_emu import config  # noqa: E402
from supa_emu.supa import _sanitizer  # noqa: E402
from supa_emu.supa._stream_races import FreedBlockReuseError, StreamRaceError  # noqa: E402

N = 1 << 16  # elements: big enough that blocks are not shared with unrelated small tensors


@pytest.fixture(autouse=True)
def sanitizer():
    torch.supa.init()
    previous = torch.supa.current_stream()
    torch.supa.synchronize()
    torch.supa.empty_cache()  # a freed block is then the only cached one of its size
    _sanitizer.enable_supa_sanitizer()
    yield _sanitizer.supa_sanitizer
    _sanitizer.disable_supa_sanitizer()
    torch.supa.set_stream(previous)


@pytest.fixture
def side():
    return torch.supa.Stream()


def _default() -> int:
    return torch.supa.default_stream().supa_stream


def _fresh(value: float = 1.0) -> torch.Tensor:
    return torch.full((N,), value, device="supa")


# ---- side-stream producer that does not wait for the data it reads ------------------------------

def test_side_stream_reading_default_stream_data_without_wait_is_a_race(side):
    x = _fresh()
    with torch.supa.stream(side):
        with pytest.raises(StreamRaceError, match="data race between streams") as caught:
            x * 2
    assert caught.value.streams == (side.supa_stream, _default())
    text = str(caught.value)
    assert "read by aten::mul" in text and "write by aten::full" in text
    assert text.count("test_sanitizer.py") >= 2  # both call sites


def test_side_stream_after_wait_stream_is_silent(side):
    x = _fresh()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        x * 2


# ---- consumer on the default stream of a side-stream write -------------------------------------

def _side_write(side):
    x = _fresh()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        y = x * 2
    return y


def test_default_stream_consumer_of_side_stream_write_is_a_race(side):
    y = _side_write(side)
    with pytest.raises(StreamRaceError) as caught:
        y + 1
    assert caught.value.streams == (_default(), side.supa_stream)
    assert "write by aten::mul" in str(caught.value) and "read by aten::add" in str(caught.value)


@pytest.mark.parametrize("how", ["wait_stream", "event", "stream_synchronize", "event_synchronize",
                                 "device_synchronize"])
def test_default_stream_consumer_after_synchronisation_is_silent(side, how):
    y = _side_write(side)
    if how == "wait_stream":
        torch.supa.current_stream().wait_stream(side)
    elif how == "event":
        event = torch.supa.Event()
        event.record(side)
        torch.supa.current_stream().wait_event(event)
    elif how == "stream_synchronize":
        side.synchronize()
    elif how == "event_synchronize":
        side.record_event().synchronize()
    else:
        torch.supa.synchronize()
    y + 1


def test_write_after_unordered_read_is_a_race(side):
    x = _fresh()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        x.sum()
    with pytest.raises(StreamRaceError) as caught:
        x.add_(1)
    assert caught.value.streams == (_default(), side.supa_stream)
    assert "read by aten::sum" in str(caught.value)


def test_in_place_op_on_side_stream_names_the_written_argument(side):
    y = _side_write(side)
    with pytest.raises(StreamRaceError, match="write by aten::mul_ of argument 'self'"):
        y.mul_(3)


def test_views_share_the_history_of_their_storage(side):
    y = _side_write(side)
    view = y[10:20]  # making a view touches no data
    with pytest.raises(StreamRaceError):
        view.sum()


# ---- event recorded before the write ------------------------------------------------------------

def test_event_recorded_before_the_write_does_not_order_it(side):
    x = _fresh()
    side.wait_stream(torch.supa.current_stream())
    event = torch.supa.Event()
    with torch.supa.stream(side):
        event.record()
        x.mul_(2)
    torch.supa.current_stream().wait_event(event)
    with pytest.raises(StreamRaceError) as caught:
        x.sum()
    assert caught.value.streams == (_default(), side.supa_stream)


def test_event_recorded_after_the_write_orders_it(side):
    x = _fresh()
    side.wait_stream(torch.supa.current_stream())
    event = torch.supa.Event()
    with torch.supa.stream(side):
        x.mul_(2)
        event.record()
    torch.supa.current_stream().wait_event(event)
    x.sum()


# ---- the caching allocator: free without record_stream, then reuse -------------------------------

def _used_on_side_then_freed(side, record: bool):
    # A cached block of the same size (from earlier tests' garbage, collected at any time) would
    # serve the next request instead of the block freed here.
    gc.collect()
    torch.supa.empty_cache()
    x = torch.empty(N, device="supa")
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        x.fill_(1)
    if record:
        x.record_stream(side)
    ptr = x.data_ptr()
    del x
    return ptr


def test_free_without_record_stream_then_reuse_is_reported(side):
    ptr = _used_on_side_then_freed(side, record=False)
    with pytest.raises(FreedBlockReuseError, match="record_stream") as caught:
        torch.empty(N, device="supa")
    assert caught.value.data_ptr == ptr
    assert caught.value.streams == (_default(), side.supa_stream)
    assert "write by aten::fill_" in str(caught.value)


def test_free_after_record_stream_then_reuse_is_silent(side):
    ptr = _used_on_side_then_freed(side, record=True)
    again = torch.empty(N, device="supa")
    assert again.data_ptr() == ptr  # the block really was handed out again


def test_free_then_synchronize_then_reuse_is_silent(side):
    _used_on_side_then_freed(side, record=False)
    torch.supa.synchronize()
    torch.empty(N, device="supa")


# ---- copies ------------------------------------------------------------------------------------

def test_non_blocking_copy_from_pinned_memory_on_side_stream_needs_a_wait(side):
    host = torch.ones(N).pin_memory()
    device = torch.empty(N, device="supa")
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        device.copy_(host, non_blocking=True)
    with pytest.raises(StreamRaceError, match="write by aten::copy_"):
        device.sum()
    torch.supa.current_stream().wait_stream(side)
    device.sum()


def test_host_reading_a_non_blocking_copy_to_pinned_memory_before_synchronising_is_a_race():
    y = _fresh(2.0)
    on_host = y.to("cpu", non_blocking=True)  # pinned; the copy is still running on the card
    with pytest.raises(StreamRaceError, match="the host") as caught:
        on_host.sum()
    assert caught.value.streams == ("host", _default())
    torch.supa.current_stream().synchronize()
    assert on_host.sum().item() == 2.0 * N


def test_host_overwriting_pinned_memory_an_async_upload_still_reads_is_a_race(side):
    host = torch.ones(N).pin_memory()
    with torch.supa.stream(side):
        host.to("supa", non_blocking=True)
    with pytest.raises(StreamRaceError, match="write by aten::fill_.*pinned host memory") as caught:
        host.fill_(2)  # the next batch, written while the upload may still read the buffer
    assert caught.value.streams == ("host", side.supa_stream)


def test_host_reuses_pinned_memory_after_the_upload_event_completes(side):
    host = torch.ones(N).pin_memory()
    with torch.supa.stream(side):
        host.to("supa", non_blocking=True)
        uploaded = side.record_event()
    uploaded.synchronize()
    host.fill_(2)


def test_blocking_copy_to_host_synchronises_the_host(side):
    y = _side_write(side)
    with torch.supa.stream(side):
        y.cpu()  # the host waits for the side stream here ...
    y + 1  # ... so work queued afterwards on any stream comes after it


# ---- collectives on bccl --------------------------------------------------------------------------

@pytest.fixture
def single_rank_group(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("bccl", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_async_collective_consumed_without_work_wait_is_a_race(side, single_rank_group):
    import torch.distributed as dist

    grad = _fresh()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        work = dist.all_reduce(grad, async_op=True)
    with pytest.raises(StreamRaceError, match="bccl communication stream") as caught:
        grad.sum()
    assert "write by bccl allreduce" in str(caught.value)
    work.wait()
    grad.sum()  # Work.wait() on the default stream orders the collective before later work


def test_collective_waits_for_the_stream_it_is_issued_on(single_rank_group):
    import torch.distributed as dist

    grad = _fresh()
    grad.mul_(2)
    dist.all_reduce(grad)  # issued on the default stream after the write; waited (sync op)
    grad.sum()


# ---- graphs -------------------------------------------------------------------------------------

def _captured_double(static_input):
    graph = torch.supa.SUPAGraph()
    with torch.supa.graph(graph):
        static_output = static_input * 2
    return graph, static_output


def test_graph_replay_on_a_side_stream_needs_the_wait_for_its_input(side):
    static_input = _fresh()
    graph, static_output = _captured_double(static_input)
    static_input.fill_(3)  # default stream
    with torch.supa.stream(side):
        with pytest.raises(StreamRaceError, match="graph replay of aten::mul") as caught:
            graph.replay()
    assert caught.value.streams == (side.supa_stream, _default())
    assert torch.equal(static_output, torch.full((N,), 6.0, device="supa"))  # it did replay


def test_graph_replay_after_wait_stream_is_silent(side):
    static_input = _fresh()
    graph, static_output = _captured_double(static_input)
    static_input.fill_(3)
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        graph.replay()
    torch.supa.current_stream().wait_stream(side)
    static_output.sum()


# ---- torch.compile ----------------------------------------------------------------------------------

def test_compiled_function_is_checked_op_by_op(side):
    # With a dispatch mode active, Dynamo leaves the frame to eager execution, so the sanitizer
    # sees the function's operators one by one (the compiled kernels do not run meanwhile).
    double_sin = torch.compile(lambda a: (a * 2).sin())
    x = _fresh()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        y = double_sin(x)
    with pytest.raises(StreamRaceError, match="write by aten::sin") as caught:
        y + 1
    assert caught.value.streams == (_default(), side.supa_stream)


# ---- training code that is correct is silent -------------------------------------------------------

def test_training_steps_with_autograd_and_optimizer_are_silent(side):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to("supa")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        batch = torch.randn(16, 32).to("supa", non_blocking=True)
        loss = model(batch).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):  # an evaluation on a side stream, correctly ordered both ways
        model(torch.randn(4, 32, device="supa")).sum().item()
    torch.supa.current_stream().wait_stream(side)
    loss = model(batch).square().mean()
    loss.backward()


def test_backward_of_a_forward_on_a_side_stream_is_ordered_by_autograd(side):
    # Autograd's engine orders the backward ops with the forward streams in C++; the sanitizer
    # sees those waits through PyTorch's GPU trace.
    weight = torch.randn(64, 64, device="supa", requires_grad=True)
    batch = torch.randn(8, 64, device="supa")
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        loss = (batch @ weight).square().sum()
    torch.supa.current_stream().wait_stream(side)
    loss.backward()
    weight.grad * 2


def test_generic_torch_event_orders_streams_too(side):
    y = _side_write(side)
    event = torch.Event(device="supa")
    event.record(side)
    torch.accelerator.current_stream().wait_event(event)
    y + 1


def test_generic_torch_stream_synchronize_orders_the_host(side):
    y = _side_write(side)
    torch.Stream(stream_id=side.stream_id, device_index=side.device_index,
                 device_type=side.device_type).synchronize()
    y + 1


# ---- report-only mode ---------------------------------------------------------------------------

def test_report_only_mode_logs_and_keeps_going(side, caplog):
    _sanitizer.disable_supa_sanitizer()
    _sanitizer.enable_supa_sanitizer(report_only=True)
    y = _side_write(side)
    with caplog.at_level(logging.ERROR, logger="supa_emu.sanitizer"):
        z = y + 1
    assert z.sum().item() == 3 * N
    reports = _sanitizer.supa_sanitizer.reports
    # The read of y, and the result landing in the block of _side_write's x, which the side
    # stream read and which was freed on return without record_stream: both real on a card.
    assert [type(r) for r in reports] == [StreamRaceError, FreedBlockReuseError]
    assert "data race between streams" in caplog.text


# ---- switch --------------------------------------------------------------------------------------

def test_bad_sanitize_value_is_a_config_error_naming_accepted_values(monkeypatch):
    monkeypatch.setenv("SUPA_EMU_SANITIZE", "races")
    with pytest.raises(config.ConfigError, match="SUPA_EMU_SANITIZE='races'.*off, streams, streams-report"):
        config.load()


def _a_race() -> None:
    s = torch.supa.Stream()
    x = torch.ones(8, device="supa")
    s.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(s):
        x.add_(1)
    with pytest.raises(StreamRaceError) as caught:
        x.sum()
    assert caught.value.streams[0] == 0, caught.value.streams


def test_environment_switch_enables_it_at_activation():
    fresh_process(_a_race, env={"SUPA_EMU_SANITIZE": "streams"})


def test_off_by_default_nothing_is_imported():
    # Code, not a function of this file: importing this file imports the sanitizer.
    result = fresh_process("""
        import sys, torch
        x = torch.ones(8, device="supa")
        torch.supa.synchronize()
        print(sorted(m for m in sys.modules if "sanitizer" in m and "switch" not in m))
    """, env={"SUPA_EMU_SANITIZE": None})
    assert result.stdout.strip() == "[]"


def test_python_call_is_reachable_as_torch_supa_sanitizer():
    assert torch.supa._sanitizer.enable_supa_sanitizer is _sanitizer.enable_supa_sanitizer
    import torch.supa._sanitizer as imported

    assert imported is _sanitizer  # one module, one state, whichever name imports it
    assert torch.supa._sanitizer is _sanitizer


def test_history_forgets_freed_storages_that_can_no_longer_race(sanitizer, side):
    for _ in range(3):
        torch.empty(N, device="supa").fill_(1)  # freed at once, used on its own stream only
    x = _fresh()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        x.sum()
    keep = x.data_ptr()
    del x  # freed while the side stream may still read it: must be kept for the reuse check
    sanitizer.history.prune()
    assert keep in sanitizer.history.storages
    assert all(not state.owner.expired() or ptr == keep for ptr, state in sanitizer.history.storages.items())


# ---- DeepSpeed on two emulated cards: ZeRO-2 with overlap_comm, ZeRO-3 with prefetch ---------------

def _sanitized_job(tmp_path, config_name: str, zero_overrides: dict, forget_waits: bool = False):
    """Runs examples/train_gpt.py on two ranks with SUPA_EMU_SANITIZE=streams-report; returns the
    per-rank summary lines and the whole stderr."""
    root = pathlib.Path(__file__).resolve().parent.parent
    config = json.loads((root / "examples" / "configs" / config_name).read_text())
    config["zero_optimization"].update(zero_overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    script = [root / "examples" / "train_gpt.py"]
    if forget_waits:
        script.insert(0, __file__)  # each rank forgets every wait, then runs the script (below)
    script += ["--config", tmp_path / "config.json", "--steps", 2, "--log-format", "json", "--vocab", 256,
               "--seq-len", 16, "--dim", 256, "--layers", 4, "--heads", 4]
    result = fresh_process(torchrun_command(*script, nproc=2, port=PORT),
                           env={"SUPA_EMU_SANITIZE": "streams-report"}, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    summaries = [line for line in result.stderr.splitlines() if "kernels checked" in line]
    assert len(summaries) == 2, result.stderr[-4000:]  # one per rank
    return summaries, result.stderr


_OVERLAP_COMM = dict(overlap_comm=True, contiguous_gradients=True)


@pytest.mark.slow
@pytest.mark.parametrize("config_name, overrides", [("zero2.json", _OVERLAP_COMM), ("zero3.json", {})],
                         ids=["zero2_overlap_comm", "zero3_prefetch"])
def test_deepspeed_zero_side_streams_are_race_free(tmp_path, config_name, overrides):
    summaries, _ = _sanitized_job(tmp_path, config_name, overrides)
    for line in summaries:
        # The side streams and the communication streams were really tracked ...
        assert "stream supa_stream=0x2" in line and "bccl communication stream" in line, line
        assert line.endswith("; 0 races reported"), line  # ... and DeepSpeed orders them correctly


@pytest.mark.slow
def test_deepspeed_zero2_overlap_comm_without_its_waits_is_reported(tmp_path):
    summaries, stderr = _sanitized_job(tmp_path, "zero2.json", _OVERLAP_COMM, forget_waits=True)
    assert all(not line.endswith("; 0 races reported") for line in summaries), summaries
    assert "data race between streams" in stderr
    assert "deepspeed/runtime/zero/stage_1_and_2.py" in stderr and "in reduce_ipg_grads" in stderr


if __name__ == "__main__":  # a torchrun rank of _sanitized_job(forget_waits=True)
    import sys

    torch.supa.Stream.wait_stream = lambda self, other: None  # the bug under test: every wait forgotten
    harness.run_as_main(sys.argv[1:])
