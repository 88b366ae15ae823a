"""torch.supa memory history and snapshots: recorded allocations, their stacks, trace settings, annotations."""


import pytest
import torch
from harness import fresh_process

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
from memory_fixtures import (  # noqa: F401  (fixtures)
    MiB, initialised, last_device, no_garbage_of_earlier_tests, segment_holding)


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
    assert any(frame["filename"].endswith("test_memory_history.py") for frame in alloc["frames"])


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


def _freed_segment_frames(context):
    """The frames of the segment_free events of one tensor's segment, made and freed on the last card."""
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


def _traced_actions(skipped):
    torch.supa.empty_cache()
    torch.supa.memory._record_memory_history(context="all", stacks="python", skip_actions=skipped)
    try:
        with torch.supa.device(last_device()):
            _make_and_free_tensor()
        torch.supa.empty_cache()
        return sorted({e["action"] for trace in torch.supa.memory._snapshot()["device_traces"] for e in trace})
    finally:
        torch.supa.memory._record_memory_history(None)


# Both run in a fresh process: the tensor must get a segment of its own, which a block another test
# file left on the same card (a cached segment it still uses) would take away.
def test_empty_cache_gives_its_stack_to_the_segments_it_frees_at_context_all():
    [frames] = fresh_process(_freed_segment_frames, "all").value
    assert "empty_cache" in frames
    # Below "all", a freed segment shows the stack of the request that reserved it.
    [frames] = fresh_process(_freed_segment_frames, "alloc").value
    assert "_freed_segment_frames" in frames and "empty_cache" not in frames
    assert fresh_process(_freed_segment_frames, "state").value == [[]]


@pytest.mark.parametrize("skipped", [["free_requested"], ["alloc"], ["segment_alloc", "segment_free"], []])
def test_skip_actions_leave_those_actions_out_of_the_trace(skipped):
    expected = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"}
    assert fresh_process(_traced_actions, skipped).value == sorted(expected - set(skipped))


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


def test_a_memory_profiling_profiler_sees_each_card_allocation_and_free_with_its_size():
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(256, device="supa")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = x + x  # a 1 KiB result from the operator fallback's path (a provisional take, committed)
        z = torch.empty(MiB, device="supa")
        del z
    by_operator = {e.key: e for e in prof.key_averages()}
    assert by_operator["aten::add"].self_device_memory_usage == y.numel() * 4
    assert by_operator["aten::empty"].self_device_memory_usage == MiB * 4
    assert by_operator["aten::add"].cpu_memory_usage == 0  # card memory, not the host's
    freed = [e.device_memory_usage for e in prof.events() if e.name == "[memory]"]
    assert freed == [-MiB * 4]
