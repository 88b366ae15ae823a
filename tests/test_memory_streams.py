"""Stream-ordered card memory: blocks per stream, record_stream, reuse under capture, pinned host blocks."""

import contextlib

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
from memory_fixtures import (  # noqa: F401  (fixtures)
    MiB, allocator_settings_restored, initialised, last_device, no_garbage_of_earlier_tests)


def segment_stream(address: int) -> int:
    """The stream of the snapshot segment holding `address`."""
    [stream] = [seg["stream"] for seg in torch.supa.memory_snapshot()
                if seg["address"] <= address < seg["address"] + seg["total_size"]]
    return stream


def test_caching_allocator_alloc_allocates_on_its_stream_and_checks_it():
    device = last_device()
    with torch.supa.device(device):
        current = torch.supa.current_stream()
        side = torch.supa.Stream()
    for stream in (None, current, current.supa_stream):
        address = torch.supa.caching_allocator_alloc(MiB, device, stream)
        assert segment_stream(address) == current.supa_stream
        torch.supa.caching_allocator_delete(address)
    for stream in (side, side.supa_stream):
        address = torch.supa.caching_allocator_alloc(MiB, device, stream)
        assert segment_stream(address) == side.supa_stream
        torch.supa.caching_allocator_delete(address)
    with torch.supa.device(device):  # the side stream's freed block serves the side stream again only
        assert torch.supa.caching_allocator_alloc(MiB, device, side) == address
        other = torch.supa.caching_allocator_alloc(MiB, device)
        assert other != address and segment_stream(other) == current.supa_stream
        for freed in (address, other):
            torch.supa.caching_allocator_delete(freed)
    with pytest.raises(TypeError, match="must be `torch.supa.Stream` or `int`"):
        torch.supa.caching_allocator_alloc(MiB, device, "side")
    if device > 0:
        with pytest.raises(ValueError, match=f"the stream is on supa:{device}, the allocation on supa:0"):
            torch.supa.caching_allocator_alloc(MiB, 0, side)


def test_a_block_freed_on_one_stream_serves_only_that_stream():
    side = torch.supa.Stream()
    with torch.supa.stream(side):
        freed = torch.empty(3 * MiB, dtype=torch.uint8, device="supa")
    address = freed.data_ptr()
    del freed
    on_default = torch.empty(3 * MiB, dtype=torch.uint8, device="supa")
    assert on_default.data_ptr() != address and segment_stream(on_default.data_ptr()) == 0
    with torch.supa.stream(side):
        again = torch.empty(3 * MiB, dtype=torch.uint8, device="supa")
    assert again.data_ptr() == address and segment_stream(address) == side.supa_stream


def test_snapshot_checks_its_device_and_covers_every_device():
    block = torch.empty(MiB, dtype=torch.uint8, device=f"supa:{last_device()}")
    segments = torch.supa._snapshot(0)["segments"]
    assert any(seg["address"] <= block.data_ptr() < seg["address"] + seg["total_size"] for seg in segments)
    with pytest.raises(AssertionError, match="Invalid device id"):
        torch.supa._snapshot(torch.supa.device_count())
    with pytest.raises(ValueError, match="Expected a supa device"):
        torch.supa._snapshot("cpu")


# ---- stream-ordered memory: record_stream and pinned host blocks ------------------------------

def _busy(stream, seconds=0.2):
    # Work queued on `stream` that outlasts the host's calls: a card's stream still running it.
    with torch.supa.stream(stream):
        torch.supa._sleep(int(seconds * torch.supa.get_device_properties().clock_rate * 1000))


def test_record_stream_keeps_a_block_until_the_stream_reaches_its_free():
    side = torch.supa.Stream()
    with torch.supa.stream(side):
        tmp = torch.empty(256, device="supa")
    ptr = tmp.data_ptr()
    tmp.record_stream(torch.supa.current_stream())
    _busy(torch.supa.current_stream())
    active = torch.supa.memory_stats()["active_bytes.all.current"]
    del tmp
    assert torch.supa.memory_stats()["active_bytes.all.current"] == active  # still in use on the card
    (state,) = [b["state"] for s in torch.supa.memory_snapshot() for b in s["blocks"] if b["address"] == ptr]
    assert state == "active_pending_free"
    with torch.supa.stream(side):
        assert torch.empty(256, device="supa").data_ptr() != ptr  # not handed out again too soon
    torch.supa.current_stream().synchronize()
    with torch.supa.stream(side):
        assert torch.empty(256, device="supa").data_ptr() == ptr  # then reused on its stream


def test_a_block_used_only_on_its_own_stream_is_reused_at_once():
    side = torch.supa.Stream()
    with torch.supa.stream(side):
        tmp = torch.empty(256, device="supa")
        ptr = tmp.data_ptr()
        tmp.record_stream(side)  # its own stream: nothing to wait for
        _busy(side)
        del tmp
        assert torch.empty(256, device="supa").data_ptr() == ptr


def test_empty_cache_waits_for_all_streams_and_counts_it():
    before = torch.supa.memory_stats()["num_sync_all_streams"]
    side = torch.supa.Stream()
    with torch.supa.stream(side):
        tmp = torch.empty(1 << 20, device="supa")
    tmp.record_stream(torch.supa.current_stream())
    _busy(torch.supa.current_stream(), 0.05)
    del tmp
    torch.supa.empty_cache()
    stats = torch.supa.memory_stats()
    assert stats["num_sync_all_streams"] == before + 1
    assert torch.supa.current_stream().query()
    assert stats["active_bytes.all.current"] == torch.supa.memory_allocated()


# Blocks freed during a graph capture after use on other streams (CUDA's graph-capture rules).

@pytest.fixture
def record_stream_reuse_in_capture(allocator_settings_restored):
    torch.supa._set_allocator_settings("graph_capture_record_stream_reuse:True")
    yield


@contextlib.contextmanager
def _capturing(stream):
    """The block's work on `stream` is captured into a graph (begun and ended explicitly), which the
    `with` statement receives (it holds card memory of its own until deleted)."""
    g = torch.supa.SUPAGraph()
    with torch.supa.stream(stream):
        g.capture_begin()
        try:
            yield g
        finally:
            g.capture_end()


def _used_on_and_freed(streams):
    """A block of the capturing (current) stream, read by `streams` once they join the capture
    (record_stream), then freed: its address, and what the streams wrote."""
    data = torch.ones(8, device="supa")
    reads = []
    for stream in streams:
        stream.wait_stream(torch.supa.current_stream())
        with torch.supa.stream(stream):
            reads.append(data + 1)
            data.record_stream(stream)
    address = data.data_ptr()
    del data
    return address, reads


def test_a_block_freed_during_capture_after_use_on_another_stream_waits_for_the_capture_to_end():
    capturing, side = torch.supa.Stream(), torch.supa.Stream()
    block = 512
    with _capturing(capturing) as graph:
        address, reads = _used_on_and_freed([side])
        capturing.wait_stream(side)  # joined, but events cannot be queried during capture
        again = torch.empty(8, device="supa")
        assert again.data_ptr() != address
        held = torch.supa.memory_stats()["active_bytes.all.current"]
    assert torch.supa.memory_stats()["active_bytes.all.current"] == held  # the freed block is still active
    # The first request once no graph captures lets it go as any freed block.
    fresh = torch.empty(8, device="supa")
    assert torch.supa.memory_stats()["active_bytes.all.current"] == held - block + block
    del reads, again, fresh, graph


@pytest.mark.emulation_only
def test_record_stream_reuse_in_capture_waits_until_the_capturing_stream_joins_the_users(
        record_stream_reuse_in_capture):
    capturing, side = torch.supa.Stream(), torch.supa.Stream()
    with _capturing(capturing):
        address, reads = _used_on_and_freed([side])
        before_join = torch.empty(8, device="supa")
        capturing.wait_stream(side)
        after_join = torch.empty(8, device="supa")
    assert before_join.data_ptr() != address
    assert after_join.data_ptr() == address


@pytest.mark.emulation_only
def test_record_stream_reuse_in_capture_needs_every_user_joined(record_stream_reuse_in_capture):
    s1, s2, s3, s4 = (torch.supa.Stream() for _ in range(4))
    with _capturing(s1):
        address, reads = _used_on_and_freed([s2, s3, s4])
        s1.wait_stream(s2)
        s3.wait_stream(s4)  # s1 has not waited for s3 nor s4 yet
        partial = torch.empty(8, device="supa")
        s1.wait_stream(s3)  # ... now for both, s4 through s3
        joined = torch.empty(8, device="supa")
    assert partial.data_ptr() != address
    assert joined.data_ptr() == address


@pytest.mark.emulation_only
def test_record_stream_reuse_in_capture_needs_an_event_recorded_after_the_free(record_stream_reuse_in_capture):
    capturing, side = torch.supa.Stream(), torch.supa.Stream()
    with _capturing(capturing):
        data = torch.ones(8, device="supa")
        side.wait_stream(capturing)
        with torch.supa.stream(side):
            read = data + 1
            data.record_stream(side)
            early = side.record_event()
            read.add_(1)  # more work on the side stream after the event: it may still read the block
        address = data.data_ptr()
        del data
        capturing.wait_event(early)
        stale = torch.empty(8, device="supa")
    assert stale.data_ptr() != address


@pytest.mark.emulation_only
def test_record_stream_reuse_in_capture_is_a_setting_kept_across_strings(allocator_settings_restored):
    torch.supa._set_allocator_settings("graph_capture_record_stream_reuse:True")
    torch.supa._set_allocator_settings("max_split_size_mb:40")
    assert torch.supa.memory._snapshot()["allocator_settings"]["graph_capture_record_stream_reuse"] is True
    torch.supa._set_allocator_settings("graph_capture_record_stream_reuse:False")
    assert torch.supa.memory._snapshot()["allocator_settings"]["graph_capture_record_stream_reuse"] is False


def test_record_stream_refuses_a_stream_of_another_device_type():
    x = torch.empty(4, device="supa")
    with pytest.raises(RuntimeError, match="expected a supa stream"):
        torch.ops.aten.record_stream(x, torch.Stream("cpu"))


def test_pinned_blocks_are_cached_and_reused():
    t = torch.ones(100).pin_memory()
    ptr = t.data_ptr()
    del t
    again = torch.ones(100).pin_memory()
    assert again.data_ptr() == ptr and again.is_pinned()
    assert again[10:].is_pinned()  # a view into a pinned block is pinned memory too


def test_a_pinned_block_read_by_a_busy_stream_waits_for_it():
    t = torch.ones(1000).pin_memory()
    ptr = t.data_ptr()
    dev = torch.empty(1000, device="supa")
    _busy(torch.supa.current_stream())
    dev.copy_(t, non_blocking=True)
    del t
    assert torch.ones(1000).pin_memory().data_ptr() != ptr  # the copy engine may still read it
    torch.supa.synchronize()
    assert torch.ones(1000).pin_memory().data_ptr() == ptr
    assert torch.equal(dev.cpu(), torch.ones(1000))


def test_empty_host_cache_keeps_live_pinned_blocks():
    live = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
    cached = torch.ones(1 << 16).pin_memory()
    del cached
    torch.accelerator.empty_host_cache()
    assert live.is_pinned() and torch.equal(live, torch.arange(1 << 16, dtype=torch.float32))
    assert torch.ones(1 << 16).pin_memory().is_pinned()


def test_a_request_of_more_than_one_exabyte_is_refused_as_cuda_refuses_it():
    keep = torch.zeros(1024, device="supa")
    ooms = torch.supa.memory_stats()["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError, match="^SUPA out of memory. Tried to allocate more than 1EB memory.$"):
        torch.empty(1024 * 1024 * 1024 * 8000000000, dtype=torch.int8, device="supa")
    assert torch.supa.memory_stats()["num_ooms"] == ooms
    keep.fill_(1)
    assert bool((keep == 1).all())
