"""torch.supa memory API: allocator statistics, caching, limits, out of memory, what counts as card memory."""

import gc

import pytest
from harness import PRISTINE, UNTOUCHED, fresh_process
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
from memory_fixtures import (  # noqa: F401  (fixtures)
    MiB, ROUNDING, initialised, last_device, no_garbage_of_earlier_tests)


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


def _stats_before_init() -> list:
    return [torch.supa.memory_stats_as_nested_dict(), dict(torch.supa.memory_stats()),
            torch.supa.memory_allocated(), torch.supa.is_initialized()]


_STATS_BEFORE_INIT = fresh_process(_stats_before_init, shared=UNTOUCHED)


def test_stats_empty_before_init():
    assert _STATS_BEFORE_INIT.result().value == [{}, {}, 0, False]


def test_one_mib_tensor_moves_allocated_by_its_size():
    before = torch.supa.memory_allocated()
    t = torch.empty(MiB // 4, dtype=torch.float32, device="supa")
    delta = torch.supa.memory_allocated() - before
    assert MiB <= delta <= MiB + ROUNDING
    assert torch.supa.memory_reserved() >= torch.supa.memory_allocated()
    assert torch.supa.max_memory_allocated() >= torch.supa.memory_allocated()
    del t
    assert torch.supa.memory_allocated() == before


def test_one_kib_tensor_is_rounded_to_512_bytes_without_padding():
    # As PyTorch's CUDA caching allocator: round_size adds nothing, so 1 KiB is two 512-byte units.
    stats = torch.supa.memory_stats()
    t = torch.ones(256, dtype=torch.float32, device="supa")
    after = torch.supa.memory_stats()
    assert after["active_bytes.all.current"] - stats["active_bytes.all.current"] == 1024
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


@pytest.mark.emulation_only
def test_freed_neighbours_merge_and_serve_the_next_request_from_the_lowest_address():
    # As the real allocator: both blocks are slices of one 20 MiB segment; freed, they merge with
    # the segment's free remainder, and the best fit (then lowest address) starts at `first`.
    dev = last_device()
    first, second = (torch.empty(3 * MiB + 4096, dtype=torch.uint8, device=f"supa:{dev}") for _ in range(2))
    addresses = first.data_ptr(), second.data_ptr()
    reserved = torch.supa.memory_reserved(dev)
    del first
    del second
    again = torch.empty(3 * MiB + 4096, dtype=torch.uint8, device=f"supa:{dev}")
    assert addresses[1] == addresses[0] + 3 * MiB + 4096
    assert again.data_ptr() == addresses[0]
    assert torch.supa.memory_reserved(dev) == reserved


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


def test_a_device_without_index_means_the_current_device():
    dev = last_device()
    index_less = torch.device("supa")
    with torch.supa.device(dev):
        block = torch.empty(MiB, dtype=torch.uint8, device=index_less)
        assert block.device.index == dev
        free, total = torch.supa.mem_get_info(index_less)
        assert total == torch.supa.get_device_properties(dev).total_memory
        assert free == torch.supa.mem_get_info(dev)[0] < total
        for query in (torch.supa.memory_allocated, torch.supa.memory_reserved, torch.supa.max_memory_allocated,
                      torch.supa.max_memory_reserved):
            assert query(index_less) == query(dev) == query("supa") > 0
        assert torch.supa.memory_stats(index_less) == torch.supa.memory_stats(dev)
        assert torch.supa.memory_summary(index_less) == torch.supa.memory_summary(dev)
        torch.supa.reset_peak_memory_stats(index_less)
        assert torch.supa.memory_stats(dev)["allocated_bytes.all.peak"] == torch.supa.memory_allocated(dev)
        segments = torch.supa._snapshot(index_less)["segments"]
        assert any(seg["address"] <= block.data_ptr() < seg["address"] + seg["total_size"] for seg in segments)


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


def _allocation_beyond_the_host() -> None:
    with pytest.raises(torch.OutOfMemoryError) as caught:
        torch.empty(1 << 40, dtype=torch.uint8, device='supa')
    assert "the host could not provide 1024.00 GiB" in str(caught.value) and "SUPA_EMU_MEMORY" in str(caught.value)
    assert "total capacity" not in str(caught.value)
    assert torch.supa.memory_reserved() == 0


# PRISTINE: nothing reserved before it
_HOST_ALLOCATION_FAILURE = fresh_process(_allocation_beyond_the_host,
                                         env={"SUPA_EMULATE": "1", "SUPA_EMU_MEMORY": "99999TiB"}, shared=PRISTINE)


def test_host_allocation_failure_is_reported_as_the_hosts():
    _HOST_ALLOCATION_FAILURE.result()


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
    assert set(snap) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert len(snap["device_traces"]) == torch.supa.device_count()
    del t


def test_fallback_kernel_scratch_is_not_the_cards():
    # A CPU kernel run for a supa op allocates its temporaries on the host, not on the card: median's
    # CPU kernel partitions a copy of its 4 MiB input, and the card holds only the one-element result,
    # as the card's figures hold an operator's results and the scratch modelled for its card kernel
    # (docs/memory_model.md, "What an operator's kernel allocates").
    dev = last_device()
    x = torch.rand(1 << 20, device=f"supa:{dev}")  # 4 MiB
    before = torch.supa.memory_allocated(dev)
    torch.supa.reset_peak_memory_stats(dev)
    result = torch.median(x)
    assert torch.supa.max_memory_allocated(dev) - before == torch.supa.memory_allocated(dev) - before == 512
    assert result.device == x.device
    assert result.item() == torch.median(x.cpu()).item()
    # Mixed-type arithmetic: the CPU kernel's cast of the bf16 operand is its own scratch too.
    a = torch.rand(1 << 18, device=f"supa:{dev}", dtype=torch.bfloat16)
    b = torch.rand(1 << 18, device=f"supa:{dev}")
    torch.supa.reset_peak_memory_stats(dev)
    before = torch.supa.memory_allocated(dev)
    total = a + b
    assert torch.supa.max_memory_allocated(dev) - before == 1 << 20  # the float32 result alone
    torch.testing.assert_close(total.cpu(), a.cpu() + b.cpu(), rtol=0, atol=0)
    # CPU work outside a supa op is not device memory.
    torch.supa.reset_peak_memory_stats(dev)
    scratch = torch.rand(1 << 20).sort().values
    assert torch.supa.max_memory_allocated(dev) == torch.supa.memory_allocated(dev)
    del scratch


_KERNELS_WITH_CPU_SIDE_STATE = [  # oneDNN primitive caches, FFT plans, LAPACK workspaces, sort buffers
    "conv2d", "conv2d backward", "lstm", "ifft", "hfft", "matmul", "svd", "sort"]


def _kernel(name: str, device: str):
    """The kernel `name` as a function of no arguments, with its module already on `device`."""
    conv = torch.nn.Conv2d(3, 8, 3).to(device)
    lstm = torch.nn.LSTM(8, 16, 2).to(device)
    return {
        "conv2d": lambda: conv(torch.randn(2, 3, 16, 16, device=device)),
        "conv2d backward": lambda: torch.autograd.grad(
            conv(torch.randn(2, 3, 16, 16, device=device)).sum(), conv.weight)[0],
        "lstm": lambda: lstm(torch.randn(5, 3, 8, device=device))[0],
        "ifft": lambda: torch.fft.ifft(torch.randn(128, device=device, dtype=torch.complex64)),
        "hfft": lambda: torch.fft.hfft(torch.randn(33, device=device, dtype=torch.complex64)),
        "matmul": lambda: torch.randn(64, 64, device=device) @ torch.randn(64, 64, device=device),
        "svd": lambda: torch.linalg.svd(torch.randn(8, 8, device=device))[0],
        "sort": lambda: torch.sort(torch.randn(10000, device=device))[0],
    }[name]


@pytest.mark.parametrize("name", _KERNELS_WITH_CPU_SIDE_STATE)
def test_cpu_side_state_of_a_kernel_never_stays_on_the_card(name):
    """What a CPU kernel keeps for later calls (caches, plans, workspaces) is not left in device
    memory: once the result is freed, the card holds what it held before, call after call."""
    dev = last_device()
    kernel = _kernel(name, f"supa:{dev}")
    for _ in range(2):  # the first call fills the caches, the second reuses them
        gc.collect()
        torch.supa._clear_sublas_workspaces()  # what the card's BLAS keeps is the card's (test_blas_workspaces.py)
        before = torch.supa.memory_allocated(dev)
        result = kernel()
        assert result.device == torch.device("supa", dev)
        del result
        gc.collect()
        torch.supa._clear_sublas_workspaces()
        assert torch.supa.memory_allocated(dev) == before
