"""torch.supa memory pools: what a MemPool owns and reuses, pools kept through empty_cache, a thread
allocating into a pool, custom allocators refused."""

import threading

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
import torch_supa._C  # noqa: E402  (a thread's allocation into a pool)
from memory_fixtures import (  # noqa: F401  (fixtures)
    MiB, initialised, last_device, no_garbage_of_earlier_tests, segment_holding)


def test_mem_pool_ids_and_use_count():
    pool = torch.supa.MemPool()
    other = torch.supa.MemPool()
    assert isinstance(pool.id, tuple) and len(pool.id) == 2
    assert pool.id != other.id
    assert pool.use_count() == 1
    assert torch.supa.MemPoolContext.active_pool() is None
    with torch.supa.use_mem_pool(pool):
        assert pool.use_count() == 2
        assert torch.supa.MemPoolContext.active_pool() is pool
        t = torch.ones(8, device="supa")
    assert pool.use_count() == 1
    assert torch.supa.MemPoolContext.active_pool() is None
    assert torch.equal(t.cpu(), torch.ones(8))
    assert pool.id[0] == 0 and pool.id[1] > 0  # user pools are (0, n), as in PyTorch


def test_mem_pool_owns_the_blocks_allocated_under_it():
    pool = torch.supa.MemPool()
    with torch.supa.use_mem_pool(pool):
        inside = torch.empty(10_000, device="supa")
    outside = torch.empty(10_000, device="supa")
    assert tuple(segment_holding(inside.data_ptr())["segment_pool_id"]) == pool.id
    assert tuple(segment_holding(outside.data_ptr())["segment_pool_id"]) == (0, 0)
    assert [seg["address"] for seg in pool.snapshot()] == [inside.data_ptr()]


def test_mem_pool_blocks_are_reused_only_inside_the_pool():
    pool = torch.supa.MemPool()
    with torch.supa.use_mem_pool(pool):
        freed = torch.empty(20_000, device="supa")
    address = freed.data_ptr()
    del freed
    # The freed block stays cached in the pool: a request of the same size outside the pool
    # gets another block, one inside the pool gets it back.
    outside = torch.empty(20_000, device="supa")
    assert outside.data_ptr() != address
    with torch.supa.use_mem_pool(pool):
        again = torch.empty(20_000, device="supa")
    assert again.data_ptr() == address
    del outside, again


def test_deleting_a_mem_pool_releases_its_cached_blocks():
    torch.supa.empty_cache()
    reserved = torch.supa.memory_reserved()
    pool = torch.supa.MemPool()
    with torch.supa.use_mem_pool(pool):
        t = torch.empty(300_000, device="supa")
    del t
    assert torch.supa.memory_reserved() > reserved
    del pool
    assert torch.supa.memory_reserved() == reserved


def test_use_mem_pool_on_another_device_does_not_route_this_one():
    if torch.supa.device_count() < 2:
        pytest.skip("needs two SUPA devices")
    pool = torch.supa.MemPool()
    with torch.supa.device(0), torch.supa.use_mem_pool(pool, device=1):
        here = torch.empty(1000, device="supa:0")
        there = torch.empty(1000, device="supa:1")
    assert tuple(segment_holding(here.data_ptr())["segment_pool_id"]) == (0, 0)
    assert tuple(segment_holding(there.data_ptr())["segment_pool_id"]) == pool.id


@pytest.mark.emulation_only
def test_custom_allocators_are_rejected_clearly():
    with pytest.raises(NotImplementedError, match="does not load custom allocator"):
        torch.supa.SUPAPluggableAllocator("alloc.so", "my_malloc", "my_free")
    with pytest.raises(NotImplementedError, match="does not load custom allocator"):
        torch.supa.change_current_allocator(object())


def _pool_segments(pool):
    return [seg for seg in torch.supa.memory_snapshot() if tuple(seg["segment_pool_id"]) == pool.id]


def test_a_live_mem_pool_keeps_its_cache_through_empty_cache():
    pool = torch.supa.MemPool()
    with torch.supa.use_mem_pool(pool):
        x = torch.empty(1 << 10, device="supa")
        del x
        torch.supa.empty_cache()  # inside the pool's context, as outside: the pool is in use
    assert len(_pool_segments(pool)) == 1
    torch.supa.empty_cache()
    assert len(_pool_segments(pool)) == 1
    del pool
    assert [seg for seg in torch.supa.memory_snapshot() if seg["segment_pool_id"][1] != 0 and
            seg["allocated_size"] == 0] == []


def test_no_split_pool_gives_each_allocation_its_own_segment():
    mib = (1 << 20) // 4
    split, no_split = torch.supa.MemPool(), torch.supa.MemPool(no_split=True)
    held = []
    for pool in (split, no_split):
        with torch.supa.use_mem_pool(pool):
            held += [torch.empty(4 * mib, device="supa"), torch.empty(4 * mib, device="supa")]
    assert len(_pool_segments(split)) == 1  # the second 4 MiB split from the first's 20 MiB segment
    assert len(_pool_segments(no_split)) == 2
    assert all(len(seg["blocks"]) == 1 for seg in _pool_segments(no_split))


def test_use_on_oom_lets_a_request_short_of_memory_take_the_pools_cache():
    dev = last_device()
    capacity = torch.supa.get_device_properties(dev).total_memory
    limit = 64 * MiB
    torch.supa.empty_cache()
    torch.supa.set_per_process_memory_fraction(limit / capacity, dev)
    try:
        for use_on_oom in (False, True):
            pool = torch.supa.MemPool(use_on_oom=use_on_oom)
            with torch.supa.use_mem_pool(pool, device=dev):
                cached = torch.empty(32 * MiB // 4, device=dev)
            del cached  # its segment stays in the pool's cache
            if use_on_oom:
                assert torch.empty(48 * MiB // 4, device=dev).numel() == 12 * MiB
            else:
                with pytest.raises(torch.OutOfMemoryError):
                    torch.empty(48 * MiB // 4, device=dev)
            del pool
            torch.supa.empty_cache()
    finally:
        torch.supa.set_per_process_memory_fraction(1.0, dev)


def test_a_thread_allocates_into_a_pool_through_torch_supa_C():
    """The real package's pool entry points (torch._C._cuda_* under the transfer), as CUDA-graph
    tooling uses them: one thread's allocations go to a pool while another thread's do not."""
    pool = torch.supa.graph_pool_handle()
    device = torch.supa.current_device()
    pool_segments = lambda: [s for s in torch.supa.memory_snapshot() if tuple(s["segment_pool_id"]) == pool]  # noqa: E731
    inside, outside = [], []
    started = threading.Barrier(2)

    def in_pool():
        stream = torch.supa.Stream()
        with torch.supa.stream(stream):
            torch_supa._C._supa_beginAllocateCurrentThreadToPool(device, pool)
            try:
                started.wait()
                inside.extend(torch.empty(20 * MiB, dtype=torch.uint8, device="supa") for _ in range(2))
            finally:
                torch_supa._C._supa_endAllocateToPool(device, pool)
        outside.append(torch.empty(20 * MiB, dtype=torch.uint8, device="supa"))  # after the end: general

    def elsewhere():
        started.wait()
        outside.extend(torch.empty(20 * MiB, dtype=torch.uint8, device="supa") for _ in range(2))

    threads = [threading.Thread(target=in_pool), threading.Thread(target=elsewhere)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s["address"] for s in pool_segments()) == sorted(t.data_ptr() for t in inside)
    assert torch_supa._C._supa_checkPoolLiveAllocations(device, pool, {t.data_ptr() for t in inside})
    assert not torch_supa._C._supa_checkPoolLiveAllocations(device, pool, {inside[0].data_ptr()})
    del inside[:]
    assert torch_supa._C._supa_checkPoolLiveAllocations(device, pool, set())
    torch.supa.empty_cache()
    assert len(pool_segments()) == 2  # the pool is held until released
    torch_supa._C._supa_releasePool(device, pool)
    torch.supa.empty_cache()
    assert pool_segments() == []
    del outside
