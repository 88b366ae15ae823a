"""torch.supa memory API: allocator statistics, caching, limits, OOM, snapshots and pools."""

import gc
import warnings

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

MiB = 1 << 20
ROUNDING = 512 + 32  # the allocator pads each block and rounds it up to 512 bytes


@pytest.fixture(autouse=True)
def initialised():
    torch.supa.init()
    gc.collect()
    yield
    gc.collect()


def last_device():
    # The highest-numbered device is the least likely to hold tensors from other tests.
    return torch.supa.device_count() - 1


def test_stats_keys_and_flattening():
    nested = torch.supa.memory_stats_as_nested_dict()
    flat = torch.supa.memory_stats()
    assert list(flat) == sorted(flat)
    for metric in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                   "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for pool in ("all", "small_pool", "large_pool"):
            for stat in ("current", "peak", "allocated", "freed"):
                key = f"{metric}.{pool}.{stat}"
                assert key in flat, key
                assert flat[key] == nested[metric][pool][stat]
    for key in ("num_alloc_retries", "num_ooms", "max_split_size", "num_sync_all_streams",
                "num_device_alloc", "num_device_free", "oversize_allocations.current", "oversize_segments.peak"):
        assert key in flat, key


def test_stats_agree_with_generic_accelerator_api():
    assert torch.supa.memory_allocated(0) == torch.accelerator.memory_allocated(0)
    assert torch.supa.memory_reserved(0) == torch.accelerator.memory_reserved(0)


def test_stats_empty_before_init(python_subprocess):
    out = python_subprocess("""
        import torch
        print(torch.supa.memory_stats_as_nested_dict(), dict(torch.supa.memory_stats()),
              torch.supa.memory_allocated(), torch.supa.is_initialized())
    """)
    assert out.stdout.split() == ["{}", "{}", "0", "False"]


def test_one_mib_tensor_moves_allocated_by_its_size():
    before = torch.supa.memory_allocated()
    t = torch.empty(MiB // 4, dtype=torch.float32, device="supa")
    delta = torch.supa.memory_allocated() - before
    assert MiB <= delta <= MiB + ROUNDING
    assert torch.supa.memory_reserved() >= torch.supa.memory_allocated()
    assert torch.supa.max_memory_allocated() >= torch.supa.memory_allocated()
    del t
    assert torch.supa.memory_allocated() == before


def test_one_kib_tensor_is_padded_and_rounded_to_1536_bytes():
    stats = torch.supa.memory_stats()
    t = torch.ones(256, dtype=torch.float32, device="supa")
    after = torch.supa.memory_stats()
    assert after["active_bytes.all.current"] - stats["active_bytes.all.current"] == 1536
    assert after["requested_bytes.all.current"] - stats["requested_bytes.all.current"] == 1024
    del t


def test_empty_cache_releases_cached_blocks():
    dev = last_device()
    t = torch.empty(4 * MiB, dtype=torch.uint8, device=f"supa:{dev}")
    reserved_live = torch.supa.memory_reserved(dev)
    del t
    assert torch.supa.memory_reserved(dev) == reserved_live  # freed block stays cached
    torch.supa.empty_cache()
    assert torch.supa.memory_reserved(dev) < reserved_live
    assert torch.supa.memory_reserved(dev) >= torch.supa.memory_allocated(dev)


def test_peak_and_accumulated_resets():
    dev = last_device()
    t = torch.empty(2 * MiB, dtype=torch.uint8, device=f"supa:{dev}")
    del t
    assert torch.supa.max_memory_allocated(dev) >= 2 * MiB
    torch.supa.reset_peak_memory_stats(dev)
    assert torch.supa.max_memory_allocated(dev) == torch.supa.memory_allocated(dev)
    torch.supa.reset_accumulated_memory_stats(dev)
    assert torch.supa.memory_stats(dev)["allocation.all.allocated"] == 0


def test_deprecated_aliases_warn():
    with pytest.warns(FutureWarning, match="reset_max_memory_allocated now calls torch.supa.reset_peak_memory_stats"):
        torch.supa.reset_max_memory_allocated()
    with pytest.warns(FutureWarning, match="reset_max_memory_cached now calls torch.supa.reset_peak_memory_stats"):
        torch.supa.reset_max_memory_cached()
    with pytest.warns(FutureWarning, match="renamed to `torch.supa.memory_reserved`"):
        assert torch.supa.memory_cached() == torch.supa.memory_reserved()
    with pytest.warns(FutureWarning, match="renamed to `torch.supa.max_memory_reserved`"):
        assert torch.supa.max_memory_cached() == torch.supa.max_memory_reserved()


def test_mem_get_info_reflects_capacity():
    free, total = torch.supa.mem_get_info(0)
    assert total == torch.supa.get_device_properties(0).total_memory
    assert 0 <= free <= total


def test_out_of_memory_error_and_recovery():
    dev = last_device()
    keep = torch.arange(16, dtype=torch.float32, device=f"supa:{dev}")
    ooms = torch.supa.memory_stats(dev)["num_ooms"]
    too_big = torch.supa.get_device_properties(dev).total_memory * 2
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(too_big, dtype=torch.uint8, device=f"supa:{dev}")
    assert str(info.value).startswith("SUPA out of memory. Tried to allocate ")
    assert f"GPU {dev} has a total capacity of" in str(info.value)
    assert torch.supa.memory_stats(dev)["num_ooms"] == ooms + 1
    assert torch.equal((keep + 1).cpu(), torch.arange(1, 17, dtype=torch.float32))


def test_memory_fraction_argument_checks():
    with pytest.raises(TypeError, match="Invalid type for fraction argument, must be `float`"):
        torch.supa.set_per_process_memory_fraction(1)
    with pytest.raises(ValueError, match=r"Invalid fraction value: 1.5. Allowed range: 0~1"):
        torch.supa.set_per_process_memory_fraction(1.5)
    with pytest.raises(ValueError, match=r"Invalid fraction value: -0.1. Allowed range: 0~1"):
        torch.supa.set_per_process_memory_fraction(-0.1)


def test_memory_fraction_limits_allocations():
    dev = last_device()
    torch.supa.empty_cache()
    total = torch.supa.get_device_properties(dev).total_memory
    assert torch.supa.get_per_process_memory_fraction(dev) == 1.0
    fraction = (torch.supa.memory_reserved(dev) + 8 * MiB) / total
    torch.supa.set_per_process_memory_fraction(fraction, dev)
    try:
        assert torch.supa.get_per_process_memory_fraction(dev) == pytest.approx(fraction)
        small = torch.empty(1024, dtype=torch.uint8, device=f"supa:{dev}")
        with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
            torch.empty(64 * MiB, dtype=torch.uint8, device=f"supa:{dev}")
        del small
    finally:
        torch.supa.set_per_process_memory_fraction(1.0, dev)
    t = torch.empty(64 * MiB, dtype=torch.uint8, device=f"supa:{dev}")
    del t
    torch.supa.empty_cache()


def test_caching_allocator_raw_alloc_and_delete():
    before = torch.supa.memory_allocated(0)
    ptr = torch.supa.caching_allocator_alloc(4096, 0)
    assert isinstance(ptr, int) and ptr != 0
    assert torch.supa.memory_allocated(0) >= before + 4096
    torch.supa.caching_allocator_delete(ptr)
    assert torch.supa.memory_allocated(0) == before
    ptr = torch.supa.caching_allocator_alloc(512, 0, torch.supa.current_stream(0))
    torch.supa.caching_allocator_delete(ptr)
    with pytest.raises(TypeError, match="Invalid type for stream argument"):
        torch.supa.caching_allocator_alloc(512, 0, "stream")
    torch.supa.caching_allocator_enable(True)


def test_memory_summary_layout():
    t = torch.empty(1024, device="supa")
    text = torch.supa.memory_summary(0)
    lines = text.splitlines()
    assert text.endswith("|\n")
    assert all(len(line) == 77 and line[0] == "|" and line[-1] == "|" for line in lines)
    assert "PyTorch SUPA memory summary, device ID 0" in lines[1]
    assert "SUPA OOMs:" in lines[3] and "supaMalloc retries:" in lines[3]
    for title in ("Allocated memory", "Active memory", "Requested memory", "GPU reserved memory",
                  "Non-releasable memory", "Allocations", "Active allocs", "GPU reserved segments",
                  "Non-releasable allocs", "Oversize allocations", "Oversize GPU segments"):
        assert f"| {title}" in text, title
    assert "from large pool" in text
    assert "from large pool" not in torch.supa.memory_summary(0, abbreviated=True)
    del t


def test_snapshot_structures():
    t = torch.empty(1024, device="supa")
    segments = torch.supa.memory_snapshot()
    assert segments
    seg = segments[0]
    for key in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"):
        assert key in seg, key
    assert {"address", "size", "requested_size", "state"} <= set(seg["blocks"][0])
    snap = torch.supa.memory._snapshot()
    assert set(snap) == {"segments", "device_traces", "allocator_settings"}
    torch.supa.memory._record_memory_history("all")
    torch.supa.memory._record_memory_history(None)
    torch.supa.memory._record_memory_history(True)
    torch.supa.memory._record_memory_history(False)
    del t


def test_dump_snapshot_writes_pickle(tmp_path):
    import pickle

    path = tmp_path / "snap.pickle"
    torch.supa.memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        assert "segments" in pickle.load(f)


def test_allocator_backend_and_settings():
    assert torch.supa.get_allocator_backend() == "native"
    torch.supa._set_allocator_settings("pinned_use_cuda_host_register:True,pinned_num_register_threads:8")


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
    assert isinstance(pool.snapshot(), list)


@pytest.mark.emulation_only
def test_custom_allocators_are_rejected_clearly():
    with pytest.raises(NotImplementedError, match="does not load custom allocator"):
        torch.supa.SUPAPluggableAllocator("/tmp/alloc.so", "my_malloc", "my_free")
    with pytest.raises(NotImplementedError, match="does not load custom allocator"):
        torch.supa.change_current_allocator(object())
