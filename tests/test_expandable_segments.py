"""Expandable segments (allocator setting expandable_segments:True), as PyTorch's CUDA caching
allocator has them: one segment per pool and stream whose 2 MiB (small pool) or 20 MiB (large
pool) pages are mapped as requests need them and unmapped by empty_cache; reserved memory is the
mapped pages (supa_emu/csrc/runtime/expandable_segments.h)."""

import pytest
from harness import fresh_process
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
from memory_fixtures import (  # noqa: F401  (fixtures)
    MiB, allocator_settings_restored, initialised, no_garbage_of_earlier_tests)

PAGE = 20 * MiB  # of the large pool
# The cases that check where blocks go run in a fresh process (no blocks left by other tests).
EXPANDABLE = {"PYTORCH_SUPA_ALLOC_CONF": "expandable_segments:True"}

pytestmark = pytest.mark.emulation_only


@pytest.fixture
def expandable(allocator_settings_restored):
    torch.supa._set_allocator_settings("expandable_segments:True")


def empty(megabytes, **kwargs):
    return torch.empty(int(megabytes * MiB), dtype=torch.uint8, device="supa", **kwargs)


def segments_of(*tensors):
    """The snapshot's segments that hold these tensors, each once, by address."""
    found = {}
    for seg in torch.supa.memory_snapshot():
        for t in tensors:
            if seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]:
                found[seg["address"]] = seg
    return [found[address] for address in sorted(found)]


def stat(name):
    stats = torch.supa.memory_stats()
    return stats[name] if stats else 0  # (empty before the card's first allocation)


def limit_card_to(megabytes):
    """As PyTorch's test_max_split_expandable: what is reserved now, plus `megabytes`."""
    total = torch.supa.get_device_properties().total_memory
    torch.supa.set_per_process_memory_fraction((megabytes * MiB + torch.supa.memory_reserved()) / total)


def test_the_setting_no_longer_warns_and_puts_requests_in_an_expandable_segment(allocator_settings_restored, recwarn):
    torch.supa._set_allocator_settings("expandable_segments:True")
    assert not [w for w in recwarn if "expandable" in str(w.message)]
    assert torch.supa.memory._snapshot()["allocator_settings"]["expandable_segments"] is True
    t = empty(5)
    (seg,) = segments_of(t)
    assert seg["is_expandable"] is True and seg["segment_type"] == "large"


def _requests_share_one_segment_that_grows_by_pages():
    segments, maps = stat("segment.large_pool.current"), stat("num_device_alloc")
    reserved = torch.supa.memory_reserved()
    a = empty(5)
    assert torch.supa.memory_reserved() - reserved == PAGE  # one 20 MiB page, not a segment of the request
    b = empty(30)  # the 15 MiB left and one more page, merged: b follows a
    assert b.data_ptr() == a.data_ptr() + 5 * MiB
    assert torch.supa.memory_reserved() - reserved == 2 * PAGE
    assert stat("num_device_alloc") - maps == 2  # one mapping per request that grew the segment
    assert stat("segment.large_pool.current") == segments  # CUDA never counts expandable segments
    (seg,) = segments_of(a, b)
    assert seg["total_size"] == 2 * PAGE
    assert [(blk["size"], blk["state"]) for blk in seg["blocks"]] == [
        (5 * MiB, "active_allocated"), (30 * MiB, "active_allocated"), (5 * MiB, "inactive")]


def test_requests_share_one_segment_that_grows_by_pages():
    # The setting given at start (the process starts without torch, which reads it).
    fresh_process(_requests_share_one_segment_that_grows_by_pages, env=EXPANDABLE, torch_first=False)


def _small_requests_map_2_mib_pages_of_their_own_segment():
    torch.supa._set_allocator_settings("expandable_segments:True")
    reserved = stat("reserved_bytes.small_pool.current")
    with torch.supa.stream(torch.supa.Stream()):  # a stream that has no small blocks yet
        small = torch.empty(100, dtype=torch.uint8, device="supa")
        large = empty(2)
    assert stat("reserved_bytes.small_pool.current") - reserved == 2 * MiB
    (seg_small,) = segments_of(small)
    (seg_large,) = segments_of(large)
    assert seg_small["is_expandable"] and seg_small["segment_type"] == "small" and seg_small["total_size"] == 2 * MiB
    assert seg_small["address"] != seg_large["address"]


def test_small_requests_map_2_mib_pages_of_their_own_segment():
    fresh_process(_small_requests_map_2_mib_pages_of_their_own_segment)


def _a_large_pool_block_splits_down_to_512_bytes_and_inactive_split_leaves_it_out():
    torch.supa._set_allocator_settings("expandable_segments:True")
    # With the setting on, the large pool splits as the small one does (CUDA's should_split), and
    # inactive_split leaves out the free blocks of expandable segments.
    t = empty(5)
    inactive = stat("inactive_split.all.current")
    del t
    u = empty(19.75)  # the free 20 MiB block serves it, leaving 256 KiB: a block of its own
    (seg,) = segments_of(u)
    assert [blk["size"] for blk in seg["blocks"]] == [int(19.75 * MiB), MiB // 4]
    assert stat("inactive_split.all.current") == inactive


def test_a_large_pool_block_splits_down_to_512_bytes_and_inactive_split_leaves_it_out():
    fresh_process(_a_large_pool_block_splits_down_to_512_bytes_and_inactive_split_leaves_it_out)


def _empty_cache_unmaps_the_whole_free_pages_and_releases_an_empty_segment():
    torch.supa._set_allocator_settings("expandable_segments:True")
    reserved, unmaps = torch.supa.memory_reserved(), stat("num_device_free")
    a, b, c = empty(10), empty(40), empty(10)  # pages [0, 60 MiB): a [0, 10), b [10, 50), c [50, 60)
    del b
    torch.supa.empty_cache()
    # b's free block holds the pages [20, 40): they go back; [10, 20) and [40, 50) stay mapped.
    assert torch.supa.memory_reserved() - reserved == 2 * PAGE
    assert stat("num_device_free") - unmaps == 1
    first, second = segments_of(a, c)  # one segment per contiguous mapped range
    assert first["is_expandable"] and second["is_expandable"]
    assert (first["address"], first["total_size"]) == (a.data_ptr(), PAGE)
    assert (second["address"], second["total_size"]) == (a.data_ptr() + 2 * PAGE, PAGE)
    assert [blk["state"] for blk in first["blocks"]] == ["active_allocated", "inactive"]
    del a, c
    torch.supa.empty_cache()
    assert torch.supa.memory_reserved() == reserved
    assert stat("num_device_free") - unmaps == 3


def test_empty_cache_unmaps_the_whole_free_pages_and_releases_an_empty_segment():
    fresh_process(_empty_cache_unmaps_the_whole_free_pages_and_releases_an_empty_segment)


def _pinned_segments_then_40_mib(expandable: bool) -> dict:
    """Under a 120 MiB limit: three 40 MiB blocks, each freed in turn and refilled with a 5 MiB block
    that stays and a 35 MiB one, which are freed at the end: 105 MiB free in 35 MiB pieces. Then
    40 MiB are asked for."""
    torch.supa._set_allocator_settings(f"expandable_segments:{expandable}")
    limit_card_to(120)
    b = [empty(40) for _ in range(3)]
    kept, filled = [], []
    for i in range(3):
        b[i] = None
        kept.append(empty(5))
        filled.append(empty(35))
    del filled
    retries = stat("num_alloc_retries")
    try:
        big = empty(40)
    except torch.OutOfMemoryError:
        return {"fits": False}
    return {"fits": True, "retries": stat("num_alloc_retries") - retries,
            "after_last_kept": big.data_ptr() == kept[-1].data_ptr() + 5 * MiB}


def test_a_40_mib_request_fits_under_120_mib_where_split_segments_run_out():
    """Each 40 MiB segment is split by the 5 MiB block left in it, so none can be given back and
    40 MiB do not fit; in an expandable segment the whole free pages are unmapped (60 MiB) and the
    request maps new ones after the last 5 MiB block (the retry after releasing the cache)."""
    assert fresh_process(_pinned_segments_then_40_mib, False).value == {"fits": False}
    fitted = fresh_process(_pinned_segments_then_40_mib, True).value
    assert fitted == {"fits": True, "retries": 1, "after_last_kept": True}


def test_pytorchs_max_split_expandable_case(allocator_settings_restored):
    """test_max_split_expandable: 40 MiB segments made with the setting off, on and off again fill
    a 120 MiB limit; once freed, a 120 MiB request releases them (the expandable one unmapped)."""
    limit_card_to(120)
    held = []
    for expandable in (False, True, False):
        torch.supa._set_allocator_settings(f"expandable_segments:{expandable},max_split_size_mb:40")
        held.append(empty(40))
    assert sorted(seg["is_expandable"] for seg in segments_of(*held)) == [False, False, True]
    with pytest.raises(torch.OutOfMemoryError):
        empty(40)
    del held
    assert empty(120).numel() == 120 * MiB


def test_blocks_of_expandable_segments_serve_no_request_once_the_setting_is_off(expandable):
    t = empty(5)
    del t  # a free 20 MiB block in the expandable segment
    torch.supa._set_allocator_settings("expandable_segments:False")
    u = empty(5)
    (seg,) = segments_of(u)
    assert seg["is_expandable"] is False and seg["total_size"] == PAGE


def test_each_stream_has_its_own_expandable_segment(expandable):
    a = empty(5)
    with torch.supa.stream(torch.supa.Stream()):
        b = empty(5)
    seg_a, seg_b = segments_of(a, b)
    assert seg_a["is_expandable"] and seg_b["is_expandable"] and seg_a["stream"] != seg_b["stream"]


def _the_memory_history_records_mappings_and_unmappings():
    torch.supa._set_allocator_settings("expandable_segments:True")
    torch.supa.memory._record_memory_history("all", stacks="python")
    try:
        t = empty(30)
        address = t.data_ptr()
        del t
        torch.supa.empty_cache()
        trace = torch.supa.memory._snapshot()["device_traces"][torch.supa.current_device()]
    finally:
        torch.supa.memory._record_memory_history(None)
    events = [(e["action"], e["addr"], e["size"]) for e in trace if e["action"].startswith("segment")]
    assert events == [("segment_map", address, 2 * PAGE), ("segment_unmap", address, 2 * PAGE)]


def test_the_memory_history_records_mappings_and_unmappings():
    fresh_process(_the_memory_history_records_mappings_and_unmappings)


def test_a_graphs_private_pool_grows_its_own_expandable_segment(expandable):
    s = torch.supa.Stream()
    a = torch.ones(1 << 20, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.stream(s):
        g.capture_begin()
        out = a * 2
        g.capture_end()
    pool = tuple(g.pool())
    (seg,) = segments_of(out)
    assert seg["is_expandable"] and tuple(seg["segment_pool_id"]) == pool
    g.replay()
    assert out.sum().item() == 2 * (1 << 20)
    del g, out
    torch.supa.empty_cache()
    assert not [seg for seg in torch.supa.memory_snapshot() if tuple(seg["segment_pool_id"]) == pool]


def test_a_mem_pool_grows_its_own_expandable_segment(expandable):
    pool = torch.supa.MemPool()
    with torch.supa.use_mem_pool(pool):
        inside = empty(5)
    outside = empty(5)
    (seg_in,), (seg_out,) = segments_of(inside), segments_of(outside)
    assert seg_in["is_expandable"] and seg_out["is_expandable"]
    assert tuple(seg_in["segment_pool_id"]) == tuple(pool.id) and seg_in["address"] != seg_out["address"]


def _planners_record():
    from supa_emu.plan import rank_record

    torch.supa._set_allocator_settings("expandable_segments:True")
    rank_record.start(None, rank=0)
    before = torch.supa.memory_reserved()
    t = empty(30)
    return rank_record.record()["peak_reserved"], torch.supa.memory_reserved(), before, t.numel()


def test_the_planners_record_counts_the_mapped_pages_as_reserved():
    peak_reserved, reserved, before, _ = fresh_process(_planners_record).value
    assert reserved - before == 2 * PAGE and peak_reserved == reserved


def test_a_no_split_mem_pool_keeps_a_segment_per_block(expandable):
    # Its contract (each block keeps its whole segment) holds with expandable segments on too, so
    # PyTorch's test_mempool_no_split passes in either mode.
    pool = torch.supa.MemPool(no_split=True)
    with torch.supa.use_mem_pool(pool):
        a, b = empty(4), empty(4)
    segments = segments_of(a, b)
    assert [(seg["is_expandable"], len(seg["blocks"])) for seg in segments] == [(False, 1), (False, 1)]


def test_nested_mem_pools_each_grow_one_range_as_pytorchs_allocator_does(expandable):
    # PyTorch's test_nested_mempool under expandable segments: a pool's second 20 MiB request maps
    # the page after its first, so `memory_snapshot(pool.id)` shows one segment of two blocks where
    # the test (written for one cudaMalloc per request) expects two; CUDA's allocator does the
    # same (docs/cuda_conformance.md#with-expandable-segments).
    pools = [torch.supa.MemPool() for _ in range(3)]
    data = []
    with torch.supa.use_mem_pool(pools[0]):
        data.append(empty(20))
        with torch.supa.use_mem_pool(pools[1]):
            data.append(empty(20))
            with torch.supa.use_mem_pool(pools[2]):
                data.append(empty(20))
            data.append(empty(20))
        data.append(empty(20))
    layouts = []
    for pool in pools:
        segments = torch.supa.memory.memory_snapshot(pool.id)
        layouts.append([(seg["is_expandable"], seg["total_size"], [blk["size"] for blk in seg["blocks"]])
                        for seg in segments])
    assert layouts == [[(True, 2 * PAGE, [PAGE, PAGE])], [(True, 2 * PAGE, [PAGE, PAGE])], [(True, PAGE, [PAGE])]]
    # each pool has a range of its own
    assert len({seg["address"] for pool in pools for seg in torch.supa.memory.memory_snapshot(pool.id)}) == 3
