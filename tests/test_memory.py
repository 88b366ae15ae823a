"""torch.supa memory API: allocator statistics, caching, limits, OOM, snapshots and pools."""

import contextlib
import gc
import re
import threading
import warnings

import pytest

from harness import PRISTINE, UNTOUCHED, run_function, shared_call
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
import torch_supa._C  # noqa: E402  (clears the BLAS workspaces)

MiB = 1 << 20
ROUNDING = 512 + 32  # the allocator pads each block and rounds it up to 512 bytes


@pytest.fixture(scope="module", autouse=True)
def no_garbage_of_earlier_tests():
    # Nor the BLAS workspaces their matrix products left (the tests below count bytes from zero).
    gc.collect()
    torch_supa._C._supa_clearSublasWorkspaces()


@pytest.fixture(autouse=True)
def initialised(no_garbage_of_earlier_tests):
    # A test starts without garbage: what earlier modules left is collected above, what each test
    # of this module leaves is collected after it (a collection costs ~0.1 s in a full run).
    torch.supa.init()
    yield
    gc.collect()


def segment_holding(address):
    """The snapshot's segment that holds `address` (earlier files may leave live blocks whose
    segments a new small tensor shares)."""
    (seg,) = [s for s in torch.supa.memory_snapshot() if s["address"] <= address < s["address"] + s["total_size"]]
    return seg


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


def _stats_before_init() -> list:
    return [torch.supa.memory_stats_as_nested_dict(), dict(torch.supa.memory_stats()),
            torch.supa.memory_allocated(), torch.supa.is_initialized()]


_STATS_BEFORE_INIT = shared_call(_stats_before_init, stage=UNTOUCHED)


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
        assert any(seg["address"] == block.data_ptr() for seg in torch.supa._snapshot(index_less)["segments"])


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
_HOST_ALLOCATION_FAILURE = shared_call(_allocation_beyond_the_host, env={"SUPA_EMULATE": "1", "SUPA_EMU_MEMORY": "99999TiB"},
                                       stage=PRISTINE)


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


def _make_and_free_tensor():
    t = torch.empty(3000, device="supa")
    address = t.data_ptr()
    del t
    return address


@pytest.fixture
def memory_history():
    torch.supa.memory._record_memory_history("all", stacks="python")
    yield
    torch.supa.memory._record_memory_history(None)


def test_memory_history_records_allocations_and_frees_with_python_stacks(memory_history):
    address = _make_and_free_tensor()
    device = torch.supa.current_device()
    events = [e for e in torch.supa.memory._snapshot()["device_traces"][device] if e["addr"] == address]
    actions = [e["action"] for e in events]
    assert "alloc" in actions and "free_completed" in actions
    assert actions.index("alloc") < actions.index("free_completed")
    alloc, freed = events[actions.index("alloc")], events[actions.index("free_completed")]
    # The size asked for, not the block's (12000 B in a block of 12288), as the card's history records it.
    assert alloc["size"] == freed["size"] == 3000 * 4 and alloc["stream"] == 0 and alloc["time_us"] > 0
    names = [frame["name"] for frame in alloc["frames"]]
    assert "_make_and_free_tensor" in names
    assert any(frame["filename"].endswith("test_memory.py") for frame in alloc["frames"])


def test_memory_history_off_records_nothing_and_clears_the_trace(memory_history):
    _make_and_free_tensor()
    torch.supa.memory._record_memory_history(None)
    _make_and_free_tensor()
    assert all(trace == [] for trace in torch.supa.memory._snapshot()["device_traces"])


def test_memory_history_keeps_the_newest_max_entries():
    torch.supa.memory._record_memory_history("all", stacks="python", max_entries=3)
    try:
        for _ in range(4):
            _make_and_free_tensor()
        trace = torch.supa.memory._snapshot()["device_traces"][torch.supa.current_device()]
        assert len(trace) == 3
        assert trace[-1]["action"] == "free_completed"
    finally:
        torch.supa.memory._record_memory_history(None)


def test_memory_history_state_mode_gives_live_blocks_their_stack():
    torch.supa.memory._record_memory_history("state", stacks="python")
    try:
        t = torch.empty(5000, device="supa")
        (block,) = [b for b in segment_holding(t.data_ptr())["blocks"] if b["address"] == t.data_ptr()]
        assert any(frame["name"] == "test_memory_history_state_mode_gives_live_blocks_their_stack"
                   for frame in block["frames"])
        _make_and_free_tensor()
        # As CUDA's: the trace keeps only the newest event.
        events = [e for trace in torch.supa.memory._snapshot()["device_traces"] for e in trace]
        assert [e["action"] for e in events] == ["free_completed"]
    finally:
        torch.supa.memory._record_memory_history(None)


def test_a_live_block_keeps_its_stack_after_recording_stops_until_it_is_freed():
    torch.supa.memory._record_memory_history("state", context="state", stacks="python")
    t = torch.empty(5000, device="supa")
    torch.supa.memory._record_memory_history(None)

    def block_frames(address):
        return [b["frames"] for s in torch.supa.memory_snapshot() for b in s["blocks"] if b["address"] == address]

    address = t.data_ptr()
    assert any(f["name"] == "test_a_live_block_keeps_its_stack_after_recording_stops_until_it_is_freed"
               for f in block_frames(address)[0])
    del t
    again = torch.empty(5000, device="supa")  # the freed block again, allocated while not recording
    assert again.data_ptr() == address and block_frames(address) == [[]]


def _alloc_then_free(context):
    """Events of a tensor allocated in `allocates` and freed in `frees`, recorded with `context`."""
    torch.supa.memory._record_memory_history("all", context=context, stacks="python")
    try:
        box = []

        def allocates():
            box.append(torch.empty(3000, device="supa"))

        def frees():
            box.clear()

        allocates()
        address = box[0].data_ptr()
        frees()
        trace = torch.supa.memory._snapshot()["device_traces"][torch.supa.current_device()]
        return {e["action"]: [f["name"] for f in e["frames"]] for e in trace if e["addr"] == address}
    finally:
        torch.supa.memory._record_memory_history(None)


def test_context_levels_decide_which_stacks_the_trace_keeps():
    # "all": each event its own stack.
    events = _alloc_then_free("all")
    assert "allocates" in events["alloc"] and "frees" in events["free_requested"]
    assert "frees" in events["free_completed"] and "allocates" not in events["free_requested"]
    # "alloc": a free shows the stack of the allocation it frees, as CUDA's trace does.
    events = _alloc_then_free("alloc")
    assert "allocates" in events["alloc"] and "allocates" in events["free_requested"]
    assert not any("frees" in frames for frames in events.values())
    # "state" and None: the trace keeps no stacks.
    for context in ("state", None):
        assert all(frames == [] for frames in _alloc_then_free(context).values())


def test_empty_cache_gives_its_stack_to_the_segments_it_frees_at_context_all():
    def freed_segment_frames(context):
        torch.supa.empty_cache()
        torch.supa.memory._record_memory_history("all", context=context, stacks="python")
        try:
            t = torch.empty(3000, device=f"supa:{last_device()}")
            del t
            torch.supa.empty_cache()
            trace = torch.supa.memory._snapshot()["device_traces"][last_device()]
            return [[f["name"] for f in e["frames"]] for e in trace if e["action"] == "segment_free"]
        finally:
            torch.supa.memory._record_memory_history(None)

    [frames] = freed_segment_frames("all")
    assert "empty_cache" in frames
    # Below "all", a freed segment shows the stack of the request that reserved it.
    [frames] = freed_segment_frames("alloc")
    assert "freed_segment_frames" in frames and "empty_cache" not in frames
    assert freed_segment_frames("state") == [[]]


@pytest.mark.parametrize("skipped", [["free_requested"], ["alloc"], ["segment_alloc", "segment_free"], []])
def test_skip_actions_leave_those_actions_out_of_the_trace(skipped):
    torch.supa.empty_cache()
    torch.supa.memory._record_memory_history(context="all", stacks="python", skip_actions=skipped)
    try:
        with torch.supa.device(last_device()):  # a card no other test file left blocks on: a segment of its own
            _make_and_free_tensor()
        torch.supa.empty_cache()
        actions = {e["action"] for trace in torch.supa.memory._snapshot()["device_traces"] for e in trace}
        expected = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"}
        assert actions == expected - set(skipped)
    finally:
        torch.supa.memory._record_memory_history(None)


def test_skip_actions_names_are_checked():
    with pytest.raises(ValueError, match="unknown action 'malloc'"):
        torch.supa.memory._record_memory_history(skip_actions=["malloc"])


def test_recording_again_keeps_the_trace_unless_clear_history():
    def traced():
        return [e for trace in torch.supa.memory._snapshot()["device_traces"] for e in trace]

    torch.supa.memory._record_memory_history("all", stacks="python")
    try:
        _make_and_free_tensor()
        recorded = len(traced())
        torch.supa.memory._record_memory_history("all", context="alloc", stacks="python")
        assert len(traced()) == recorded
        torch.supa.memory._record_memory_history("all", stacks="python", clear_history=True)
        assert traced() == []
    finally:
        torch.supa.memory._record_memory_history(None)


def test_memory_metadata_tags_the_events_recorded_while_it_is_set(memory_history):
    torch.supa.memory._set_memory_metadata("warm-up step")
    try:
        assert torch.supa.memory._get_memory_metadata() == "warm-up step"
        _make_and_free_tensor()
    finally:
        torch.supa.memory._set_memory_metadata("")
    _make_and_free_tensor()
    assert torch.supa.memory._get_memory_metadata() == ""
    trace = torch.supa.memory._snapshot()["device_traces"][torch.supa.current_device()]
    blocks = [(e["action"], e["user_metadata"]) for e in trace if not e["action"].startswith("segment")]
    assert blocks == [(action, tag) for tag in ("warm-up step", "")
                      for action in ("alloc", "free_requested", "free_completed")]


def test_compile_context_names_the_compiled_region_of_each_event():
    @torch.compile(backend="eager")
    def twice_plus_one(a):
        return a * 2 + 1

    x = torch.ones(7, device="supa")
    torch.supa.memory._record_memory_history("all", stacks="python", compile_context=True)
    try:
        outside = torch.empty(11, device="supa")
        inside = twice_plus_one(x)
        trace = torch.supa.memory._snapshot()["device_traces"][torch.supa.current_device()]
    finally:
        torch.supa.memory._record_memory_history(None)
    regions = {e["addr"]: e["compile_context"] for e in trace if e["action"] == "alloc"}
    assert regions[outside.data_ptr()] == "N/A"
    assert regions[inside.data_ptr()].startswith("Torch-Compiled Region: ")


def test_record_function_ranges_are_kept_as_annotations():
    torch.supa.memory._record_memory_history("all", stacks="python")
    try:
        with torch.profiler.record_function("## optimizer step ##"):
            _make_and_free_tensor()
        annotations = torch.supa.memory._snapshot()["external_annotations"]
    finally:
        torch.supa.memory._record_memory_history(None)
    assert [(a["name"], a["stage"]) for a in annotations] == [("## optimizer step ##", "START"),
                                                              ("## optimizer step ##", "END")]
    assert annotations[0]["device"] == torch.supa.current_device()
    assert annotations[0]["time_us"] <= annotations[1]["time_us"]
    assert torch.supa.memory._snapshot()["external_annotations"] == []  # dropped with the trace


def test_snapshot_augmented_with_fx_traces_names_the_graph_nodes():
    class AddRelu(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x + 1)

    with torch.fx.experimental._config.patch("enrich_profiler_metadata", True):
        graph_module = torch.fx.symbolic_trace(AddRelu())
    torch.supa.memory._record_memory_history("all", stacks="python")
    try:
        out = graph_module(torch.ones(100, device="supa"))
        plain = torch.supa.memory._snapshot()
        augmented = torch.supa.memory._snapshot(augment_with_fx_traces=True)
    finally:
        torch.supa.memory._record_memory_history(None)

    def fx_nodes(snapshot):
        return {f.get("fx_node_name") for trace in snapshot["device_traces"] for e in trace for f in e["frames"]}

    assert fx_nodes(plain) == {None}
    assert {"add", "relu"} <= fx_nodes(augmented)
    del out


def test_memory_snapshot_of_a_pool_lists_only_its_segments():
    outer, inner = torch.supa.MemPool(), torch.supa.MemPool()
    twenty_mib = 20 * MiB // 4  # each a segment of its own
    kept = []
    with torch.supa.use_mem_pool(outer):
        kept.append(torch.empty(twenty_mib, device="supa"))
        with torch.supa.use_mem_pool(inner):
            kept.append(torch.empty(twenty_mib, device="supa"))
        kept.append(torch.empty(twenty_mib, device="supa"))
    segments = torch.supa.memory.memory_snapshot(outer.id)
    assert {s["address"] for s in segments} == {kept[0].data_ptr(), kept[2].data_ptr()}
    assert [s["address"] for s in torch.supa.memory.memory_snapshot(inner.id)] == [kept[1].data_ptr()]
    assert segments == outer.snapshot()


def test_memory_history_rejects_bad_arguments():
    with pytest.raises(ValueError, match="enabled must be"):
        torch.supa.memory._record_memory_history("sometimes")
    with pytest.raises(ValueError, match="stacks must be"):
        torch.supa.memory._record_memory_history("all", stacks="cpp")


def test_legacy_record_memory_history_form(memory_history):
    torch.supa.memory._record_memory_history(True, trace_alloc_max_entries=100)
    address = _make_and_free_tensor()
    device = torch.supa.current_device()
    assert any(e["addr"] == address for e in torch.supa.memory._snapshot()["device_traces"][device])
    torch.supa.memory._record_memory_history(False)
    assert torch.supa.memory._snapshot()["device_traces"][device] == []


def test_dumped_snapshot_opens_in_pytorch_memory_viz(tmp_path, memory_history):
    import pickle

    from torch.cuda import _memory_viz

    torch.supa.empty_cache()
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device="supa")  # a segment of its own: a cudaMalloc
    _make_and_free_tensor()
    path = tmp_path / "snap.pickle"
    torch.supa.memory._dump_snapshot(str(path))
    with open(path, "rb") as f:
        data = pickle.load(f)
    # PyTorch's own readers of a CUDA snapshot: the text trace, the segment summary, the
    # flame-graph input and the HTML trace plot.
    text = _memory_viz.trace(data)
    assert "entries" in text and "cudaMalloc" in text and "del " in text
    assert "segments:" in _memory_viz.segsum(data)
    # Live blocks carry the stack that allocated them (here: `keep`, made in this test).
    assert "test_dumped_snapshot_opens_in_pytorch_memory_viz" in _memory_viz.memory(
        data, format_flamegraph=lambda lines: lines)
    assert "<html>" in _memory_viz.trace_plot(data).lower() or "html" in _memory_viz.trace_plot(data).lower()
    del keep


@pytest.mark.emulation_only
def test_allocator_backend_and_settings():
    assert torch.supa.get_allocator_backend() == "native"
    with pytest.warns(UserWarning, match="not modelled by the emulator"):
        torch.supa._set_allocator_settings("pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    settings = torch.supa.memory._snapshot()["allocator_settings"]
    assert settings["pinned_use_supa_host_register"] is True
    assert settings["pinned_num_register_threads"] == 8
    torch.supa._set_allocator_settings("pinned_use_cuda_host_register:False,pinned_num_register_threads:1")


@pytest.mark.emulation_only
def test_expandable_segments_is_a_documented_no_op_that_warns():
    with pytest.warns(UserWarning, match="expandable_segments:True is not modelled by the emulator"):
        torch.supa._set_allocator_settings("expandable_segments:True")
    t = torch.empty(1 << 20, device="supa")
    (seg,) = [s for s in torch.supa.memory_snapshot() if s["address"] == t.data_ptr()]
    assert seg["is_expandable"] is False
    torch.supa._set_allocator_settings("expandable_segments:False")


BAD_ALLOCATOR_SETTINGS = {
    "no_such_knob:1": "unrecognized or malformed entry 'no_such_knob:1'; known keys: ",
    "pinned_num_register_threads:many": "invalid value 'many' for pinned_num_register_threads",
    "pinned_num_register_threads:3": "pinned_num_register_threads: must be a power of two, at most 128",
    "pinned_reserve_segment_size_mb:0": "pinned_reserve_segment_size_mb: must be greater than 0",
    "backend:cudaMallocAsync": "only backend is 'native'",
    "max_split_size_mb:8": "max_split_size_mb: too small, must be >= 20",
    "garbage_collection_threshold:1.5": "garbage_collection_threshold: must be between 0.0 and 1.0",
    "roundup_power2_divisions:3": "roundup_power2_divisions: the number of divisions must be a power of two",
    # A rejected string changes nothing, not even its valid entries.
    "garbage_collection_threshold:0.5,no_such_knob:1": "unrecognized or malformed entry 'no_such_knob:1'",
}


@pytest.mark.emulation_only
@pytest.mark.parametrize("setting", list(BAD_ALLOCATOR_SETTINGS))
def test_allocator_settings_reject_bad_input(setting):
    before = torch.supa.memory._snapshot()["allocator_settings"]
    with pytest.raises(RuntimeError, match=re.escape(BAD_ALLOCATOR_SETTINGS[setting])):
        torch.supa._set_allocator_settings(setting)
    assert torch.supa.memory._snapshot()["allocator_settings"] == before


# ---- allocator settings that change accounting -------------------------------------------------

@pytest.fixture
def allocator_settings_restored():
    """The settings are process-wide: put back what the test changed, and start from an empty cache."""
    from supa_emu.supa import _allocator_config

    saved = dict(_allocator_config._settings)
    torch.supa.empty_cache()
    yield
    torch.supa.empty_cache()
    _allocator_config._settings.update(saved)
    torch.supa.set_per_process_memory_fraction(1.0)
    torch.supa._native()._set_allocator_knobs(saved["max_split_size"], saved["garbage_collection_threshold"],
                                              saved["roundup_power2_divisions"],
                                              saved["graph_capture_record_stream_reuse"])


MiB = 1 << 20


@pytest.mark.emulation_only
def test_roundup_power2_divisions_rounds_requests(allocator_settings_restored):
    size = 3 * MiB + 100  # +32 bytes of padding: between 2 MiB and 4 MiB
    held = torch.supa.memory_allocated()  # what earlier tests in this process still hold
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == (size + 32 + 511) // 512 * 512
    del x
    torch.supa._set_allocator_settings("roundup_power2_divisions:4")  # 2, 2.5, 3, 3.5, 4 MiB
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == 3 * MiB + MiB // 2
    del x
    # Per-interval form: one division below 512 MiB, so the plain 512-byte rounding applies here.
    torch.supa._set_allocator_settings("roundup_power2_divisions:[256:1,>:4]")
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == (size + 32 + 511) // 512 * 512
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == [1] * 9 + [4] * 7
    del x
    # 'N:d' names the interval [N MiB, 2N MiB): 8 steps of 512 KiB between 4 and 8 MiB.
    torch.supa._set_allocator_settings("roundup_power2_divisions:[4:8,>:1]")
    x = torch.empty(5 * MiB + 100, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == 5 * MiB + MiB // 2


# PyTorch 2.13's allocator config reads the list form so (the value each of the 16 intervals from
# 1 MiB gets): an entry sets its own interval, the first also those below, '>' those after the
# last named; the rest stay 0.
ROUNDUP_LISTS = {
    "[64:8,128:2,256:2,512:2,1024:1,>:1]": [8] * 7 + [2] * 3 + [1] * 6,
    "[256:1,>:4]": [1] * 9 + [4] * 7,
    "[1:2,64:8,>:1]": [2, 0, 0, 0, 0, 0, 8] + [1] * 9,
    "[64:8,1024:1]": [8] * 7 + [0, 0, 0, 1] + [0] * 5,
    "[256:1,64:8]": [1] * 6 + [8, 1, 1] + [0] * 7,
    "[>:2]": [0] + [2] * 15,
}


@pytest.mark.emulation_only
@pytest.mark.parametrize("text", list(ROUNDUP_LISTS))
def test_roundup_power2_divisions_list_reads_as_pytorchs(text, allocator_settings_restored):
    torch.supa._set_allocator_settings(f"roundup_power2_divisions:{text}")
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == ROUNDUP_LISTS[text]


@pytest.mark.emulation_only
def test_each_settings_string_resets_the_accounting_settings_it_does_not_name(allocator_settings_restored):
    size = 3 * MiB + 100  # +32 bytes of padding
    held = torch.supa.memory_allocated()
    with pytest.warns(UserWarning, match="not modelled"):
        torch.supa._set_allocator_settings("roundup_power2_divisions:4,max_split_size_mb:40,"
                                           "garbage_collection_threshold:0.5,pinned_num_register_threads:8")
    torch.supa._set_allocator_settings("expandable_segments:False")
    # As on CUDA: rounding, max_split_size and the threshold are back to their defaults ...
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == (size + 32 + 511) // 512 * 512
    assert torch.supa.memory_stats()["max_split_size"] == -1
    settings = torch.supa.memory._snapshot()["allocator_settings"]
    assert settings["garbage_collection_threshold"] == 0.0
    # ... and a setting the string does not name otherwise keeps its value.
    assert settings["pinned_num_register_threads"] == 8
    torch.supa._set_allocator_settings("pinned_num_register_threads:1")


@pytest.mark.emulation_only
def test_max_split_size_counts_oversize_blocks_and_lets_them_serve_smaller_requests(allocator_settings_restored):
    torch.supa._set_allocator_settings("max_split_size_mb:32")
    stats = torch.supa.memory_stats()
    assert stats["max_split_size"] == 32 * MiB
    segments = stats["segment.all.current"]
    allocated = torch.supa.memory_allocated()
    big = torch.empty(40 * MiB, dtype=torch.uint8, device="supa")
    stats = torch.supa.memory_stats()
    assert (stats["oversize_allocations.current"], stats["oversize_segments.current"]) == (1, 1)
    del big
    assert torch.supa.memory_stats()["oversize_allocations.current"] == 0
    # A request below max_split_size never takes an oversize block: a new segment.
    small = torch.empty(30 * MiB, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_stats()["segment.all.current"] == segments + 2
    # An oversize request takes a cached oversize block less than 20 MiB larger, whole.
    reused = torch.empty(35 * MiB, dtype=torch.uint8, device="supa")
    stats = torch.supa.memory_stats()
    assert stats["segment.all.current"] == segments + 2 and stats["oversize_allocations.current"] == 1
    assert torch.supa.memory_allocated() - allocated == 30 * MiB + 40 * MiB
    del small, reused


@pytest.mark.emulation_only
def test_garbage_collection_threshold_releases_the_oldest_cached_blocks(allocator_settings_restored):
    with torch.supa.device(last_device()):  # a card no other test file left blocks on
        try:
            _garbage_collection_threshold_case()
        finally:
            torch.supa.set_per_process_memory_fraction(1.0)


def _garbage_collection_threshold_case():
    # Blocks of 10 MiB or more get segments of their own size (rounded to 2 MiB).
    torch.supa.set_per_process_memory_fraction(1 / 256)
    limit = torch.supa.get_device_properties(0).total_memory // 256
    eighth = limit // 8 - 512
    blocks = [torch.empty(eighth, dtype=torch.uint8, device="supa") for _ in range(3)]
    addresses = [b.data_ptr() for b in blocks]
    while blocks:  # freed in order 0, 1, 2
        del blocks[0]
    assert torch.supa.memory_reserved() == 3 * limit // 8
    torch.supa._set_allocator_settings("garbage_collection_threshold:0.5")
    frees = torch.supa.memory_stats()["num_device_free"]
    fresh = torch.empty(limit // 4 - 512, dtype=torch.uint8, device="supa")  # 3/8 + 2/8 > 1/2: collect
    # Only the least recently freed block went back: 2/8 + 2/8 is within the threshold.
    assert torch.supa.memory_stats()["num_device_free"] == frees + 1
    assert torch.supa.memory_reserved() == 4 * limit // 8
    cached = {s["address"] for s in torch.supa.memory_snapshot() if s["allocated_size"] == 0}
    assert cached == set(addresses[1:])
    del fresh


@pytest.mark.emulation_only
def test_pytorchs_own_settings_entry_sets_the_supa_allocator(allocator_settings_restored):
    size = 3 * MiB + 100  # +32 bytes of padding
    held = torch.supa.memory_allocated()
    torch._C._accelerator_setAllocatorSettings("roundup_power2_divisions:4")
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == 3 * MiB + MiB // 2
    del x
    # A bad entry raises ValueError, as CUDA's allocator config does, and changes nothing.
    for bad in ("foo:1,bar:2", "release_lock_on_cudamalloc:none", "pinned_num_register_threads:none",
                "pinned_num_register_threads:1024"):
        with pytest.raises(ValueError):
            torch._C._accelerator_setAllocatorSettings(bad)
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == [4] * 16
    torch._C._accelerator_setAllocatorSettings("")
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == [0] * 16


@pytest.mark.emulation_only
def test_segments_made_with_and_without_expandable_segments_fill_a_limited_card(allocator_settings_restored):
    """PyTorch's test_max_split_expandable: CUDA maps a 40 MiB request in an expandable segment as two
    20 MiB pages, the emulator as a 40 MiB segment; the card fills and empties the same way."""
    torch.supa.set_per_process_memory_fraction(
        (120 * MiB + torch.supa.memory_reserved()) / torch.supa.get_device_properties().total_memory)
    held = []
    for expandable in (False, True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # expandable_segments:True is not modelled
            torch.supa._set_allocator_settings(f"expandable_segments:{expandable},max_split_size_mb:40")
        held.append(torch.empty(40 * MiB, dtype=torch.uint8, device="supa"))
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(40 * MiB, dtype=torch.uint8, device="supa")
    del held
    # The cached 40 MiB segments go back to make room.
    assert torch.empty(120 * MiB, dtype=torch.uint8, device="supa").numel() == 120 * MiB
    torch.supa._set_allocator_settings("expandable_segments:False")


def _allocated_and_max_split_size() -> list:
    x = torch.empty(3 * 2**20 + 100, dtype=torch.uint8, device="supa")
    seen = [torch.supa.memory_allocated(), torch.supa.memory_stats()["max_split_size"]]
    del x
    return seen


@pytest.mark.emulation_only
def test_allocator_conf_variable_applies_at_start_and_is_validated():
    result = run_function(_allocated_and_max_split_size,
                          env={"PYTORCH_SUPA_ALLOC_CONF": "roundup_power2_divisions:4,max_split_size_mb:64"})
    assert result.value == [3 * MiB + MiB // 2, 64 * MiB]
    bad = run_function(_allocated_and_max_split_size, env={"PYTORCH_SUPA_ALLOC_CONF": "max_split_size_mb:lots"},
                       check=False)
    assert bad.returncode != 0
    assert "PYTORCH_SUPA_ALLOC_CONF='max_split_size_mb:lots': invalid value 'lots' for max_split_size_mb" in bad.stderr


@pytest.mark.emulation_only
def test_disabling_the_caching_allocator_warns_that_it_is_not_modelled():
    with pytest.warns(UserWarning, match="not modelled by the emulator"):
        torch.supa.caching_allocator_enable(False)
    torch.supa.caching_allocator_enable(True)


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
    assert any(seg["address"] == block.data_ptr() for seg in segments)
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
