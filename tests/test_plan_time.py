"""The planner's time on the card: card profiles, operator costs, streams and events, collectives,
reports and the trace (supa_emu/card_profiles.py, supa_emu/plan/op_costs.py, time_model.py,
collective_time.py, op_stream.py, trace.py; docs/time_on_the_card.md).

FLOPs are checked against hand-computed counts, a collective against the ring formula written out
here, the stream schedule against its critical path worked out by hand; the recorded operator
stream of a small training script must give the same times in both planner modes.
"""

import dataclasses
import json
import pathlib
import sys

import pytest
from harness import fresh_process

from supa_emu import card_profiles
from supa_emu.plan import collective_time, op_costs, time_model
from supa_emu.plan.__main__ import main as plan_main

SCRIPTS = pathlib.Path(__file__).resolve().parent / "data" / "plan"
H100 = card_profiles.PROFILES["H100-SXM-80GB"]


def t(dtype, *sizes):
    """A supa tensor as the operator stream gives it."""
    return (dtype, op_costs.SUPA, tuple(sizes))


# ------------------------------------------------------------------------------------------------
# FLOPs and bytes
# ------------------------------------------------------------------------------------------------
def test_matrix_products_count_two_flops_per_multiply_add():
    assert op_costs.cost("aten::mm", [t("BFloat16", 64, 32), t("BFloat16", 32, 16)], [t("BFloat16", 64, 16)]).flops \
        == 2 * 64 * 32 * 16
    addmm = op_costs.cost("aten::addmm", [t("Float", 16), t("Float", 64, 32), t("Float", 32, 16), 1, 1],
                          [t("Float", 64, 16)])
    assert (addmm.kind, addmm.flops, addmm.family) == ("gemm", 2 * 64 * 32 * 16, "fp32")
    bmm = op_costs.cost("aten::bmm", [t("Half", 8, 64, 32), t("Half", 8, 32, 16)], [t("Half", 8, 64, 16)])
    assert (bmm.flops, bmm.family) == (2 * 8 * 64 * 32 * 16, "fp16")
    baddbmm = op_costs.cost("aten::baddbmm", [t("Half", 8, 64, 16), t("Half", 8, 64, 32), t("Half", 8, 32, 16), 1, 1],
                            [t("Half", 8, 64, 16)])
    assert baddbmm.flops == 2 * 8 * 64 * 32 * 16
    # bytes: both operands read, the result written (bf16: 2 bytes an element)
    mm = op_costs.cost("aten::mm", [t("BFloat16", 64, 32), t("BFloat16", 32, 16)], [t("BFloat16", 64, 16)])
    assert mm.bytes == 2 * (64 * 32 + 32 * 16 + 64 * 16)


def test_convolution_counts_each_output_against_its_window():
    # 3 -> 8 channels, 3x3 kernel, groups 1, a 2x3x30x30 output: 2 * outputs * (3*3*3)
    ins = [t("Float", 2, 3, 32, 32), t("Float", 8, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1]
    conv = op_costs.cost("aten::convolution", ins, [t("Float", 2, 8, 30, 30)])
    assert (conv.kind, conv.flops) == ("conv", 2 * (2 * 8 * 30 * 30) * (3 * 3 * 3))
    # grouped (4 groups of 2 input channels): the window is the group's channels
    ins = [t("Float", 1, 8, 10, 10), t("Float", 8, 2, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 4]
    assert op_costs.cost("aten::convolution", ins, [t("Float", 1, 8, 10, 10)]).flops == 2 * 800 * 18
    # backward for input and weight: two forwards' worth
    backward = [t("Float", 2, 8, 30, 30), t("Float", 2, 3, 32, 32), t("Float", 8, 3, 3, 3), [8], [1, 1], [0, 0],
                [1, 1], False, [0, 0], 1, [True, True, False]]
    assert op_costs.cost("aten::convolution_backward", backward, []).flops == 2 * 2 * (2 * 8 * 30 * 30) * 27


@pytest.mark.parametrize("causal", [False, True])
def test_attention_counts_as_the_fused_kernels_do(causal):
    b, h, s, d = 2, 8, 1024, 64
    q = t("BFloat16", b, h, s, d)
    full = 4 * b * h * s * s * d  # QK^T and PV, 2 FLOPs a multiply-add each
    expected = full / 2 if causal else full
    forward = op_costs.cost("aten::_scaled_dot_product_flash_attention", [q, q, q, 0.0, causal, False, None], [q])
    assert (forward.kind, forward.flops, forward.family) == ("attention_forward", expected, "bf16")
    sdpa = op_costs.cost("aten::scaled_dot_product_attention", [q, q, q, None, 0.0, causal, None, False], [q])
    assert sdpa.flops == expected
    lse = t("Float", b, h, s)
    backward = op_costs.cost("aten::_scaled_dot_product_flash_attention_backward",
                             [q, q, q, q, q, lse, None, None, s, s, 0.0, causal, None, None, None], [q, q, q])
    assert (backward.kind, backward.flops) == ("attention_backward", 2.5 * expected)
    # grouped-query heads: the score products are per query head
    kv = t("BFloat16", b, 2, s, d)
    gqa = op_costs.cost("aten::_scaled_dot_product_efficient_attention", [q, kv, kv, None, True, 0.0, causal, None],
                        [q])
    assert gqa.flops == expected


def test_views_launch_nothing_and_host_copies_take_the_link():
    assert op_costs.cost("aten::view", [t("Float", 4, 4), [16]], [t("Float", 16)]).kind == "none"
    assert op_costs.cost("aten::transpose.int", [t("Float", 4, 4), 0, 1], [t("Float", 4, 4)]).kind == "none"
    to_card = op_costs.cost("aten::copy_", [t("Float", 1024), ("Float", 0, (1024,)), False], [t("Float", 1024)])
    assert (to_card.kind, to_card.bytes, to_card.host_waits) == ("h2d", 4096, False)
    to_host = op_costs.cost("aten::copy_", [("Float", 0, (1024,)), t("Float", 1024), False], [("Float", 0, (1024,))])
    assert (to_host.kind, to_host.host_waits) == ("d2h", True)
    assert op_costs.cost("aten::_local_scalar_dense", [t("Float")], []).host_waits


# ------------------------------------------------------------------------------------------------
# Card profiles
# ------------------------------------------------------------------------------------------------
def test_profiles_carry_the_published_figures():
    assert card_profiles.PROFILES["BR100"].peak_flops["bf16"] == 1024e12
    assert card_profiles.PROFILES["BR104"].peak_flops["bf16"] == 512e12
    assert card_profiles.PROFILES["BR104"].memory_bandwidth == 819e9
    assert card_profiles.PROFILES["H200"].memory_bandwidth == 4.8e12
    assert card_profiles.PROFILES["H100-96GB-HBM2e"].memory_bandwidth == 2.4e12


def test_a_profile_file_round_trips(tmp_path):
    fields = card_profiles.as_fields(H100)
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items() if k != "peak_flops"]
    lines += ["[peak_flops]"] + [f"{k} = {v}" for k, v in fields["peak_flops"].items()]
    (tmp_path / "card.toml").write_text("\n".join(lines) + "\n")
    assert card_profiles.choose(str(tmp_path / "card.toml")) == H100


@pytest.mark.parametrize("change, field", [
    ("memory_bandwidth = -1", "memory_bandwidth"),
    ("bf16 = 'fast'", "peak_flops.bf16"),
    ("colour = 'red'", "colour"),
])
def test_a_bad_profile_file_is_one_line_naming_the_field(tmp_path, capsys, change, field):
    fields = card_profiles.as_fields(H100)
    top = {k: v for k, v in fields.items() if k != "peak_flops"}
    peaks = dict(fields["peak_flops"])
    key, _, value = change.partition(" = ")
    (peaks if key in peaks else top)[key] = "REPLACED"
    lines = [f"{k} = {json.dumps(v)}" if v != "REPLACED" else change for k, v in top.items()]
    if key not in top and key not in peaks:
        lines.append(change)
    lines += ["[peak_flops]"] + [f"{k} = {v}" if v != "REPLACED" else change for k, v in peaks.items()]
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines) + "\n")
    assert plan_main(["--world-size", "2", "--card", str(path), "--", str(SCRIPTS / "timed_steps.py")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"'{field}'" in error, error


def test_an_unknown_card_name_lists_the_cards(capsys):
    assert plan_main(["--world-size", "2", "--card", "A100", "--", str(SCRIPTS / "timed_steps.py")]) == 2
    error = capsys.readouterr().err
    assert "--card A100" in error and "H200" in error and "BR104" in error


# ------------------------------------------------------------------------------------------------
# Collectives
# ------------------------------------------------------------------------------------------------
def test_a_large_all_reduce_in_one_host_takes_the_ring():
    n, nbytes = 8, 1 << 30
    bw = H100.card_link_bandwidth * collective_time.LINK_EFFICIENCY
    ring = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * collective_time.LINK_LATENCY
    assert collective_time.seconds("all_reduce", nbytes, n, 1, H100, 400) == pytest.approx(ring)


def test_a_group_across_hosts_runs_at_its_nics():
    # 32 ranks, one per host (a data-parallel group of FSDP 32 x TP 8): each rank's 400 Gb/s NIC
    n, nbytes = 32, 1 << 30
    bw = 400e9 / 8 * collective_time.NETWORK_EFFICIENCY
    expected = (n - 1) / n * nbytes / bw + (n - 1) * collective_time.NETWORK_LATENCY
    assert collective_time.seconds("all_gather_into_tensor", nbytes, n, 32, H100, 400) == pytest.approx(expected)
    # 8 ranks on each of 4 hosts: eight NICs carry the rings, capped by the card's link
    assert collective_time.bus_bandwidth(H100, 400, 4, 8) == pytest.approx(
        min(H100.card_link_bandwidth * collective_time.LINK_EFFICIENCY, 8 * bw))
    assert collective_time.seconds("all_reduce", nbytes, 1, 1, H100, 400) == 0.0


# ------------------------------------------------------------------------------------------------
# Streams and events
# ------------------------------------------------------------------------------------------------
def _op(name, stream, ins, outs):
    return (time_model.OP, name, 0, stream, 0, ins, outs)


def _schedule():
    profile = dataclasses.replace(H100, launch_latency=0.0)
    return time_model.Schedule(profile, host_op_s=0.0)


@pytest.mark.parametrize("waits", [True, False])
def test_an_event_wait_orders_two_streams(waits):
    names = ["aten::mm", "aten::add.Tensor"]
    big = ([t("BFloat16", 4096, 4096), t("BFloat16", 4096, 4096)], [t("BFloat16", 4096, 4096)])
    small = ([t("BFloat16", 1024, 1024), t("BFloat16", 1024, 1024)], [t("BFloat16", 1024, 1024)])
    entries = [_op(0, 1, *big),  # a product on the side stream
               (time_model.EVENT_RECORD, -1, 0, 1, 77, [], []),
               _op(1, 0, *small)]  # independent work on the default stream
    if waits:
        entries.append((time_model.EVENT_WAIT, -1, 0, 0, 77, [], []))
    entries += [_op(1, 0, *small), (time_model.MARK, -1, 0, 0, time_model.STEP_MARK, [], [])]
    schedule = _schedule()
    schedule.feed(entries, names, [])
    a = max(schedule.seconds(op_costs.cost(names[0], *big)))
    b = max(schedule.seconds(op_costs.cost(names[1], *small)))
    step = schedule.steps[0]
    # waiting: the second add starts when the product ends; not waiting: both adds run beside it
    assert step["seconds"] == pytest.approx(max(a, b) + b if waits else max(a, 2 * b))
    assert sum(step["split"].values()) == pytest.approx(step["seconds"])
    assert step["flops"] == 2 * 4096 ** 3


def test_the_host_bounds_a_step_of_small_launches():
    schedule = time_model.Schedule(dataclasses.replace(H100, launch_latency=0.0), host_op_s=10e-6)
    tiny = ([t("Float", 4), t("Float", 4)], [t("Float", 4)])
    schedule.feed([_op(0, 0, *tiny)] * 100 + [(time_model.MARK, -1, 0, 0, time_model.STEP_MARK, [], [])],
                  ["aten::add.Tensor"], [])
    step = schedule.steps[0]
    assert step["seconds"] == pytest.approx(100 * 10e-6, rel=1e-3)
    assert step["split"]["host"] > 0.9 * step["seconds"]


# ------------------------------------------------------------------------------------------------
# Collectives on their communicator's stream
# ------------------------------------------------------------------------------------------------
BIG = ([t("BFloat16", 4096, 4096), t("BFloat16", 4096, 4096)], [t("BFloat16", 4096, 4096)])
GRADIENTS = 1 << 28  # 256 MiB all-reduced in a group of 8 in one host


def _mark(index, stream=0):
    return (time_model.MARK, -1, 0, stream, index, [], [])


def _play(entries, records):
    schedule = _schedule()
    schedule.feed(entries + [_mark(time_model.STEP_MARK)], ["aten::mm"], records)
    return schedule


def _all_reduce_seconds():
    return collective_time.seconds("all_reduce", GRADIENTS, 8, 1, H100, 400)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_an_async_collective_overlaps_compute_until_its_wait(asynchronous):
    # all_reduce(async_op=...), then a product that does not need it, then work.wait()
    records = [time_model.Collective("all_reduce", GRADIENTS, 8, 1, "dp", asynchronous), time_model.Waited(0)]
    schedule = _play([_mark(0), _op(0, 0, *BIG), _mark(1)], records)
    product, reduce = max(schedule.seconds(op_costs.cost("aten::mm", *BIG))), _all_reduce_seconds()
    assert reduce > product  # so the wait finds it running
    step = schedule.steps[0]
    assert step["seconds"] == pytest.approx(max(product, reduce) if asynchronous else product + reduce)
    # exposed: what the stream waited for (the collective beyond the product), or all of it
    assert step["split"]["communication"] == pytest.approx(reduce - product if asynchronous else reduce)
    assert step["split"]["compute"] == pytest.approx(product)


def test_a_wait_holds_the_stream_that_waits():
    # async all_reduce, wait, then the product: it cannot start before the collective ends
    records = [time_model.Collective("all_reduce", GRADIENTS, 8, 1, "dp", True), time_model.Waited(0)]
    schedule = _play([_mark(0), _mark(1), _op(0, 0, *BIG)], records)
    product = max(schedule.seconds(op_costs.cost("aten::mm", *BIG)))
    assert schedule.steps[0]["seconds"] == pytest.approx(_all_reduce_seconds() + product)


@pytest.mark.parametrize("communicators", [("dp", "dp"), ("dp", "tp")])
def test_collectives_of_one_communicator_run_one_after_another(communicators):
    records = [time_model.Collective("all_reduce", GRADIENTS, 8, 1, c, True) for c in communicators]
    schedule = _play([_mark(0), _mark(1, stream=3)], records)  # issued from two streams
    reduce = _all_reduce_seconds()
    one_communicator = communicators[0] == communicators[1]
    assert schedule.steps[0]["seconds"] == pytest.approx(2 * reduce if one_communicator else reduce)
    # nobody waited: the host waits for them at the step's end, which counts as exposed
    assert schedule.steps[0]["split"]["communication"] == pytest.approx(schedule.steps[0]["seconds"])


def test_a_synchronous_collective_waits_for_its_communicator():
    # an async all_reduce on the data-parallel communicator, then a synchronous one on it from another stream
    records = [time_model.Collective("all_reduce", GRADIENTS, 8, 1, "dp", True),
               time_model.Collective("all_reduce", GRADIENTS, 8, 1, "dp", False)]
    schedule = _play([_mark(0), _mark(1, stream=2), _op(0, 2, *BIG)], records)
    product, reduce = max(schedule.seconds(op_costs.cost("aten::mm", *BIG))), _all_reduce_seconds()
    assert schedule.steps[0]["seconds"] == pytest.approx(2 * reduce + product)


def test_a_barrier_wait_holds_the_host():
    records = [time_model.Collective("barrier", 4, 8, 1, "world", True), time_model.Waited(0, host=True)]
    schedule = _play([_mark(0), _mark(1)], records)
    barrier = collective_time.seconds("barrier", 4, 8, 1, H100, 400)
    assert schedule.host == pytest.approx(barrier) and barrier > 0


# ------------------------------------------------------------------------------------------------
# The recorded stream: both modes, the report, the trace
# ------------------------------------------------------------------------------------------------
def _launched_flops():
    """The matrix products and attention one forward and backward launch, as the recorder saw them."""
    import torch
    import torch.nn.functional as F

    from supa_emu import process_state

    core = process_state.core()
    x = torch.randn(2, 4, 64, 32, device="supa", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, device="supa", dtype=torch.bfloat16, requires_grad=True)
    core._op_trace_enable(True)
    out = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    y = F.linear(out, w).sum()
    y.backward()
    core._op_trace_enable(False)
    names = core._op_trace_names()
    return [(names[e[1]], op_costs.cost(names[e[1]], e[5], e[6]).flops) for e in core._op_trace_take() if e[0] == 0]


@pytest.mark.emulation_only
def test_the_recorder_sees_each_launch_once_with_its_shapes():
    launched = fresh_process(_launched_flops, env={"SUPA_EMULATE": "1"}).value
    products = [(n, f) for n, f in launched if f]
    attention = 4 * 2 * 4 * 64 * 64 * 32 / 2
    linear = 2 * (2 * 4 * 64) * 32 * 48
    assert products[0] == ("aten::scaled_dot_product_attention", attention)
    assert sum(f for n, f in products if n == "aten::mm") == 3 * linear  # forward, and two in backward
    assert any(n.startswith("aten::_scaled_dot_product_") and f == 2.5 * attention for n, f in products)
    assert not any(n in ("aten::linear", "aten::matmul", "aten::empty.memory_format") for n, _ in launched)


def _launched_under_a_sharded_subclass():
    """The matrix products an mm of two wrapper tensors launches: like DTensor, each reports a
    global size (4x its plain tensor's rows) and runs the operator on its plain tensors."""
    import torch
    from torch.utils._pytree import tree_map

    from supa_emu import process_state

    class Sharded(torch.Tensor):
        @staticmethod
        def __new__(cls, local):
            size = (4 * local.shape[0], *local.shape[1:])
            return torch.Tensor._make_wrapper_subclass(cls, size, dtype=local.dtype, device=local.device)

        def __init__(self, local):
            self.local = local

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda a: a.local if isinstance(a, Sharded) else a  # noqa: E731
            return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    core = process_state.core()
    a, w = Sharded(torch.randn(16, 32, device="supa")), torch.randn(32, 24, device="supa")
    core._op_trace_enable(True)
    torch.mm(a, w)
    core._op_trace_enable(False)
    names = core._op_trace_names()
    return [(names[e[1]], op_costs.cost(names[e[1]], e[5], e[6]).flops) for e in core._op_trace_take() if e[0] == 0]


@pytest.mark.emulation_only
def test_an_operator_on_a_python_subclass_launches_as_its_plain_tensors():
    # the card multiplies the 16-row shard, not the 64 rows the wrapper reports; once
    assert fresh_process(_launched_under_a_sharded_subclass, env={"SUPA_EMULATE": "1"}).value == [
        ["aten::mm", 2 * 16 * 32 * 24]]  # (a list: the value comes back as JSON)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    directory = tmp_path_factory.mktemp("timed")
    reports = {}
    for mode in ("compute", "shapes"):
        out = directory / f"{mode}.json"
        fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", "16", "--cards-per-host", "8",
                       "--mode", mode, "--card", "H200", "--json", str(out),
                       "--trace", str(directory / f"{mode}.trace.json"), "--plot", str(directory / f"{mode}.html"),
                       "--", str(SCRIPTS / "timed_steps.py")], timeout=600, check=False)
        reports[mode] = (json.loads(out.read_text()), json.loads((directory / f"{mode}.trace.json").read_text()),
                         (directory / f"{mode}.html").read_text())
    return reports


@pytest.mark.slow
@pytest.mark.emulation_only
def test_both_modes_plan_the_same_times(plans):
    compute, shapes = plans["compute"][0], plans["shapes"][0]
    for rank in ("0", "15"):
        timed = compute["ranks"][rank]["time"]
        assert timed["card"] == "H200" and len(timed["steps"]) == 3
        assert timed["tokens_per_step"] == 2 * 64 and timed["tokens_per_s"] > 0 and 0 < timed["mfu"] < 1
        assert timed == shapes["ranks"][rank]["time"]
        assert any(op["op"] == "bccl:all_reduce" for op in timed["top_ops"])
    assert compute["ranks"]["0"]["capacity"] == card_profiles.PROFILES["H200"].memory_bytes


@pytest.mark.slow
@pytest.mark.emulation_only
def test_the_trace_has_a_track_per_stream(plans):
    trace = plans["compute"][1]
    events = trace["traceEvents"]
    kernels = [e for e in events if e["ph"] == "X"]
    assert kernels and all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in kernels)
    named = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    streams = {(e["pid"], e["tid"]) for e in kernels}
    # the default stream, the copies' and the communicator's own (the gradients' async all_reduces)
    assert streams <= set(named) and len({tid for pid, tid in streams if pid == 0}) == 3
    assert sum(named[stream].endswith("(communicator)") for stream in streams if stream[0] == 0) == 1
    assert any(e["ph"] == "C" and e["name"] == "card memory" for e in events)
    # the HTML page charts the memory over the planned time too, and tabulates the step time
    page = plans["compute"][2]
    assert page.count("<svg") == 2 and "planned time on the card" in page and "ms on H200" in page
    assert sum(1 for e in events if e["ph"] == "i" and e["pid"] == 15) == 3


def test_a_collective_without_a_cost_is_named_not_guessed():
    schedule = _schedule()
    schedule.feed([(time_model.MARK, -1, 0, 0, 0, [], []), (time_model.MARK, -1, 0, 0, time_model.STEP_MARK, [], [])],
                  [], [time_model.Collective("teleport", 1 << 20, 8, 1)])
    assert schedule.report()["untimed_collectives"] == [{"op": "teleport", "count": 1}]


@pytest.mark.slow
@pytest.mark.emulation_only
def test_a_planned_async_all_reduce_overlaps_the_products_beside_it(tmp_path):
    steps = {}
    for flag in ("", "--sync"):
        out, trace = tmp_path / f"plan{flag}.json", tmp_path / f"plan{flag}.trace.json"
        fresh_process([sys.executable, "-m", "supa_emu.plan", "--world-size", "2", "--rank", "0", "--mode", "shapes",
                       "--card", "H200", "--json", str(out), "--trace", str(trace), "--",
                       str(SCRIPTS / "async_overlap.py"), *([flag] if flag else [])], timeout=600)
        timed = json.loads(out.read_text())["ranks"]["0"]["time"]
        ops = {op["op"]: op["seconds"] / 3 for op in timed["top_ops"]}  # a step's share of each
        tracks = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
                  if e["ph"] == "M" and e["name"] == "thread_name"}
        steps[flag] = (timed["step_seconds"], ops.pop("aten::mm"), ops.pop("bccl:all_reduce"), sum(ops.values()),
                       tracks)
    (overlapped, products, reduce, rest, tracks), (serial, *_, sync_tracks) = steps[""], steps["--sync"]
    assert reduce > 0.5 * products and products > 0.5 * reduce  # comparable, so the overlap shows
    # the rest (the sum and the update after the wait) runs after both either way
    assert overlapped == pytest.approx(max(products, reduce) + rest, rel=0.03)
    assert serial == pytest.approx(products + reduce + rest, rel=0.03)
    assert any(name.endswith("(communicator)") for name in tracks)  # the async all_reduce's own track
    assert not any(name.endswith("(communicator)") for name in sync_tracks)
