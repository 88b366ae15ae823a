"""torch.supa streams and events: identity, selection, context managers, ordering and timing."""

import re

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

multi_device = pytest.mark.skipif(torch.supa.device_count() < 2, reason="needs two SUPA devices")


@pytest.fixture(autouse=True)
def restore_device_and_stream():
    torch.supa.init()
    prev_dev = torch.supa.current_device()
    prev_stream = torch.supa.current_stream()
    yield
    torch.supa.set_stream(prev_stream)
    torch.supa.set_device(prev_dev)


def test_default_stream_identity_and_repr():
    s = torch.supa.default_stream()
    assert isinstance(s, torch.supa.Stream) and isinstance(s, torch.Stream)
    assert s.supa_stream == 0
    assert s.device == torch.device("supa", torch.supa.current_device())
    assert repr(s) == f"<torch_supa.supa.Stream device=supa:{torch.supa.current_device()} supa_stream=0x0>"
    assert torch.supa.current_stream() == s


def test_new_stream_properties():
    s = torch.supa.Stream()
    assert s.supa_stream != 0
    assert s.priority == 0
    assert s != torch.supa.default_stream()
    assert s == torch.supa.Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
    assert hash(s) == hash(torch.supa.Stream(stream_id=s.stream_id, device_index=s.device_index,
                                             device_type=s.device_type))
    assert (s == "not a stream") is False
    assert re.fullmatch(r"<torch_supa\.supa\.Stream device=supa:\d+ supa_stream=0x[0-9a-f]+>", repr(s))
    assert s.query() is True
    s.synchronize()
    least, greatest = torch.supa.Stream.priority_range()
    assert greatest <= least
    high = torch.supa.Stream(priority=greatest)
    assert high.priority == greatest


def test_priority_is_known_to_the_core_for_streams_made_by_any_api():
    # A stream made through the generic torch.Stream API, then wrapped by its id, still
    # reports the priority it was created with: the core, not torch.supa, keeps it.
    idx = torch.supa.current_device()
    generic = torch.Stream(device=torch.device("supa", idx), priority=-1)
    wrapped = torch.supa.Stream(stream_id=generic.stream_id, device_index=generic.device_index,
                                device_type=generic.device_type)
    assert wrapped.priority == -1
    low = torch.Stream(device=torch.device("supa", idx), priority=0)
    assert torch.supa.Stream(stream_id=low.stream_id, device_index=low.device_index,
                             device_type=low.device_type).priority == 0
    assert torch.supa.default_stream().priority == 0


def test_stream_context_selects_and_restores():
    s = torch.supa.Stream()
    before = torch.supa.current_stream()
    with torch.supa.stream(s):
        assert torch.supa.current_stream() == s
        x = torch.ones(4, device="supa") * 3
    assert torch.supa.current_stream() == before
    assert torch.equal(x.cpu(), torch.full((4,), 3.0))
    with torch.supa.stream(None):  # no-op
        assert torch.supa.current_stream() == before


def test_torch_stream_with_statement_works_for_supa_streams():
    s = torch.supa.Stream()
    with s:
        assert torch.supa.current_stream() == s
    assert torch.supa.current_stream() == torch.supa.default_stream()


def test_set_stream_and_set_stream_by_id():
    s = torch.supa.Stream()
    torch.supa.set_stream(s)
    assert torch.supa.current_stream() == s
    torch.supa.set_stream(None)
    assert torch.supa.current_stream() == s
    d = torch.supa.default_stream()
    torch.supa.set_stream_by_id(d.stream_id, d.device_index, d.device_type)
    assert torch.supa.current_stream() == d


@multi_device
def test_stream_context_on_other_device_restores_both_devices():
    torch.supa.set_device(0)
    s1 = torch.supa.Stream(device=1)
    assert s1.device == torch.device("supa:1")
    with torch.supa.stream(s1):
        assert torch.supa.current_device() == 1
        assert torch.supa.current_stream() == s1
    assert torch.supa.current_device() == 0
    assert torch.supa.current_stream(1) == torch.supa.default_stream(1)
    assert torch.supa.current_stream(0) == torch.supa.default_stream(0)


def test_external_stream_wraps_existing_handle():
    s = torch.supa.Stream()
    ext = torch.supa.ExternalStream(s.supa_stream)
    assert ext.supa_stream == s.supa_stream
    assert ext == s


def test_event_lifecycle_and_repr():
    e = torch.supa.Event()
    assert isinstance(e, torch.Event)
    assert repr(e) == "<torch_supa.supa.Event uninitialized>"
    assert e.device is None
    e.record()
    assert re.fullmatch(r"<torch_supa\.supa\.Event 0x[0-9a-f]+>", repr(e))
    assert e.device == torch.device("supa", torch.supa.current_device())
    e.synchronize()
    assert e.query() is True
    e.wait()


def test_elapsed_time_with_timing():
    start = torch.supa.Event(enable_timing=True)
    end = torch.supa.Event(enable_timing=True)
    start.record()
    x = torch.randn(64, 64, device="supa")
    for _ in range(3):
        x = x @ x
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0


def test_elapsed_time_needs_recorded_events():
    # ValueError, as CUDA's events raise (torch's test_cuda.py, test_events_elapsedtime).
    start = torch.supa.Event(enable_timing=True)
    end = torch.supa.Event(enable_timing=True)
    start.record()
    with pytest.raises(ValueError, match="Both events must be recorded before calculating elapsed time"):
        start.elapsed_time(end)


def test_elapsed_time_needs_timing_events_and_says_so_first():
    start = torch.supa.Event()
    end = torch.supa.Event()
    start.record()
    end.record()
    with pytest.raises(ValueError, match="Both events must be created with argument 'enable_timing=True'"):
        start.elapsed_time(end)
    with pytest.raises(ValueError, match="enable_timing=True"):  # checked before the records, as CUDA does
        torch.supa.Event().elapsed_time(torch.supa.Event())


@multi_device
def test_elapsed_time_refuses_events_of_two_devices():
    start = torch.supa.Event(enable_timing=True)
    end = torch.supa.Event(enable_timing=True)
    start.record(torch.supa.current_stream(0))
    end.record(torch.supa.current_stream(1))
    with pytest.raises(torch.AcceleratorError, match="SUPA error: invalid resource handle.*supa:0.*supa:1"):
        start.elapsed_time(end)


def test_elapsed_time_measures_the_time_between_records():
    import time

    start = torch.supa.Event(enable_timing=True)
    end = torch.supa.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    assert start.elapsed_time(end) >= 20.0
    assert end.elapsed_time(start) <= -20.0


_event_log = []


def _log_events():
    # Registered once per process: the trace registries have no removal, like torch.cuda's.
    if not _event_log:
        _event_log.append(("start", 0, 0))
        torch.supa._gpu_trace.register_callback_for_event_record(
            lambda event, stream: _event_log.append(("record", event, stream)))
        torch.supa._gpu_trace.register_callback_for_event_wait(
            lambda event, stream: _event_log.append(("wait", event, stream)))
    return len(_event_log)


def test_wait_stream_records_on_the_source_and_waits_on_the_target():
    # Work is synchronous in the emulator, so the order itself cannot go wrong here; what can
    # is the dependency wait_stream sets up, which the trace callbacks make observable.
    side = torch.supa.Stream()
    main = torch.supa.current_stream()
    start = _log_events()
    side.wait_stream(main)
    (record, wait) = _event_log[start:]
    assert record[0] == "record" and record[2] == main.stream_id
    assert wait == ("wait", record[1], side.stream_id) and record[1] != 0


def test_wait_stream_orders_work_between_streams():
    # The data check is meant for a real card, where the streams run concurrently.
    side = torch.supa.Stream()
    x = torch.zeros(8, device="supa")
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        x.add_(2)
    torch.supa.current_stream().wait_stream(side)
    assert torch.equal(x.cpu(), torch.full((8,), 2.0))
    event = side.record_event()
    assert isinstance(event, torch.supa.Event)
    torch.supa.current_stream().wait_event(event)
    assert event.query()


# ---- a stream made busy by _sleep answers as a card's does -----------------------------------

BUSY_S = 0.1  # short: the checks are of order, not of how long


def _sleep_cycles(seconds):
    return int(seconds * torch.supa.get_device_properties().clock_rate * 1000)


def test_sleep_makes_the_current_stream_busy_until_it_is_synchronized():
    stream = torch.supa.Stream()
    other = torch.supa.Stream()
    with torch.supa.stream(stream):
        torch.supa._sleep(_sleep_cycles(BUSY_S))
    assert stream.query() is False
    assert other.query() is True and torch.supa.default_stream().query() is True
    stream.synchronize()
    assert stream.query() is True


def test_sleep_busies_the_device_until_synchronize():
    stream = torch.supa.Stream()
    with torch.supa.stream(stream):
        torch.supa._sleep(_sleep_cycles(BUSY_S))
    torch.supa.synchronize()
    assert stream.query() is True
    with torch.supa.stream(stream):
        torch.supa._sleep(_sleep_cycles(BUSY_S))
    torch.accelerator.synchronize()
    assert stream.query() is True


def test_event_recorded_after_a_sleep_completes_with_it():
    stream = torch.supa.current_stream()
    before = stream.record_event(torch.supa.Event(enable_timing=True))
    torch.supa._sleep(_sleep_cycles(BUSY_S))
    after = stream.record_event(torch.supa.Event(enable_timing=True))
    assert before.query() is True
    assert after.query() is False
    with pytest.raises(RuntimeError, match="Both events must be completed before calculating elapsed time"):
        before.elapsed_time(after)
    after.synchronize()
    assert after.query() is True and stream.query() is True
    assert isinstance(before.elapsed_time(after), float)


def test_a_captured_sleep_is_a_launch_of_the_graph_not_of_the_capture():
    capturing, replaying = torch.supa.Stream(), torch.supa.Stream()
    graph = torch.supa.SUPAGraph()
    x = torch.zeros(4, device="supa")
    with torch.supa.stream(capturing):
        graph.capture_begin()
        torch.supa._sleep(_sleep_cycles(BUSY_S))
        x.add_(1)
        graph.capture_end()
    assert capturing.query() is True  # capture records the sleep; nothing runs
    with torch.supa.stream(replaying):
        graph.replay()
    assert replaying.query() is False and capturing.query() is True
    replaying.synchronize()
    assert replaying.query() is True
    assert x.tolist() == [1.0] * 4


def test_wait_event_and_wait_stream_carry_the_busy_time_to_the_waiting_stream():
    busy = torch.supa.Stream()
    by_event, by_stream = torch.supa.Stream(), torch.supa.Stream()
    with torch.supa.stream(busy):
        torch.supa._sleep(_sleep_cycles(BUSY_S))
    by_event.wait_event(busy.record_event())
    by_stream.wait_stream(busy)
    assert by_event.query() is False and by_stream.query() is False
    by_event.synchronize()
    assert by_event.query() is True and busy.query() is True
    assert by_stream.query() is True


def test_sleep_accepts_only_int64_cycle_counts():
    with pytest.raises(RuntimeError, match="expected 'int'"):
        torch.supa._sleep(1.5)
    with pytest.raises(RuntimeError, match="Overflow when unpacking long"):
        torch.supa._sleep(1 << 64)
    torch.supa._sleep(-5)  # a spin of no cycles, as CUDA's kernel
    assert torch.supa.current_stream().query() is True


# ---- streams rebuilt from their fields, selection out of range, event flags ----------------------

def test_stream_rebuilt_from_the_fields_of_an_index_less_generic_stream():
    generic = torch.Stream("supa")  # no index: the current device, as for CUDA
    assert generic.device_index == torch.supa.current_device()
    rebuilt = torch.supa.Stream(stream_id=generic.stream_id, device_index=generic.device_index,
                                device_type=generic.device_type)
    assert rebuilt == generic and rebuilt.stream_id != torch.supa.current_stream().stream_id
    with torch.supa.stream(rebuilt):
        torch.supa._sleep(_sleep_cycles(BUSY_S))
    assert generic.query() is False  # the same stream, not a copy of its name
    generic.synchronize()


def test_stream_fields_of_another_device_type_or_device_are_refused():
    s = torch.supa.Stream()
    with pytest.raises(RuntimeError, match="Expected a supa stream"):
        torch.supa.Stream(stream_id=s.stream_id, device_index=0, device_type=0)
    with pytest.raises(torch.AcceleratorError, match="SUPA error: invalid device ordinal"):
        torch.supa.Stream(stream_id=s.stream_id, device_index=torch.supa.device_count(), device_type=s.device_type)
    with pytest.raises(torch.AcceleratorError, match="invalid device ordinal"):
        torch.supa.Stream(stream_id=s.stream_id, device_index=1 << 20, device_type=s.device_type)  # no wrap to 0


@pytest.mark.parametrize("past_last", [0, 100])
def test_current_stream_of_a_device_out_of_range_raises_invalid_device_ordinal(past_last):
    index = torch.supa.device_count() + past_last
    with pytest.raises(torch.AcceleratorError, match=rf"SUPA error: invalid device ordinal \(device {index},"):
        torch.accelerator.current_stream(index)
    with pytest.raises(torch.AcceleratorError, match="SUPA error: invalid device ordinal"):
        torch.supa.current_stream(index)
    with pytest.raises(torch.AcceleratorError, match="SUPA error: invalid device ordinal"):
        torch.supa.default_stream(index)


def test_external_event_flag_is_accepted_and_the_event_works():
    event = torch.supa.Event(enable_timing=True, external=True)
    event.record()
    torch.supa.current_stream().wait_event(event)
    event.synchronize()
    assert event.query() is True


def test_stream_capture_flag_outside_capture():
    assert torch.supa.is_current_stream_capturing() is False


@pytest.mark.emulation_only
def test_ipc_handle_round_trip_within_emulator():
    e = torch.supa.Event(interprocess=True)
    e.record()
    handle = e.ipc_handle()
    assert isinstance(handle, bytes)
    reopened = torch.supa.Event.from_ipc_handle(torch.supa.current_device(), handle)
    assert reopened.query()
    with pytest.raises(RuntimeError, match="Event can only be created on SUPA devices"):
        torch.supa.Event.from_ipc_handle(torch.device("cpu"), handle)


def test_blocking_host_copies_and_item_wait_for_the_stream_non_blocking_ones_do_not():
    src = torch.ones(1000, device="supa")
    stream = torch.supa.current_stream()
    torch.supa._sleep(_sleep_cycles(BUSY_S))
    src.to("cpu", non_blocking=True)
    assert stream.query() is False
    assert torch.equal(src.to("cpu"), torch.ones(1000))
    assert stream.query() is True
    torch.supa._sleep(_sleep_cycles(BUSY_S))
    assert src.sum().item() == 1000.0
    assert stream.query() is True
