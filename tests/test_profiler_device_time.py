"""torch.profiler's device time for supa kernels is the card's modelled time (supa_emu/card_time.py).

A profile that asks for the device activity gets one card event per launch, linked to the operator
that made it, lasting what the planner's cost model gives on the chosen card profile: FLOPs over
the dtype's peak times the efficiency curve's fraction at that size, or bytes over the memory
bandwidth times the memory curve's, whichever is longer. The expected times here are computed
from the profile's figures and efficiency.CURVES' points, not by calling the model.
"""

import json
import math

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from supa_emu import card_profiles, card_time, config, process_state
from supa_emu.plan import efficiency

pytestmark = pytest.mark.skipif(not process_state.is_active(), reason="needs the emulated supa device")

CARD = card_profiles.PROFILES["BR100"]
DEVICE = (ProfilerActivity.CPU, ProfilerActivity.PrivateUse1)


@pytest.fixture(autouse=True)
def timed_on_br100():
    """The card track on BR100 whatever SUPA_EMU_PROFILER_CARD says; the configured card after."""
    card_time.install(CARD)
    yield
    card_time.install(process_state.config().profiler_card)


def _fraction(curve: str, work: float) -> float:
    """efficiency.CURVES' fraction at `work`: straight lines between its points on a log scale of
    the work, flat beyond the ends."""
    points = efficiency.CURVES[curve]
    if work <= points[0][0]:
        return points[0][1]
    for (w0, f0), (w1, f1) in zip(points, points[1:]):
        if work <= w1:
            return f0 + (f1 - f0) * math.log(work / w0) / math.log(w1 / w0)
    return points[-1][1]


def _device_us(prof, name: str) -> float:
    rows = [row for row in prof.key_averages() if row.key == name]
    assert len(rows) == 1, [row.key for row in prof.key_averages()]
    return rows[0].self_device_time_total


def _card_events(prof) -> list:
    events = prof.events() if isinstance(prof, profile) else prof.function_events  # torch.autograd.profiler's
    return [e for e in events if e.device_type == DeviceType.PrivateUse1]


def test_a_matmul_takes_its_flops_at_the_efficiency_of_its_size():
    m, k, n = 1024, 1024, 1024
    a, b = torch.randn(m, k, device="supa"), torch.randn(k, n, device="supa")
    with profile(activities=DEVICE) as prof:
        a @ b
    flops = 2.0 * m * k * n
    arithmetic = flops / (CARD.peak_flops["fp32"] * _fraction("gemm", flops))  # float32: the fp32 peak
    moved = 4.0 * (m * k + k * n + m * n)
    memory = moved / (CARD.memory_bandwidth * _fraction("memory", moved))
    assert arithmetic > memory  # this shape is bound by its arithmetic
    assert _device_us(prof, "aten::mm") == pytest.approx(arithmetic * 1e6, abs=1e-3)
    (kernel,) = _card_events(prof)
    assert kernel.name == "card:aten::mm"
    assert kernel.time_range.elapsed_us() == pytest.approx(arithmetic * 1e6, abs=1e-3)


def test_a_bfloat16_matmul_runs_at_the_bf16_peak():
    m, k, n = 2048, 2048, 2048
    a = torch.randn(m, k, device="supa", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="supa", dtype=torch.bfloat16)
    with profile(activities=DEVICE) as prof:
        torch.mm(a, b)
    flops = 2.0 * m * k * n
    arithmetic = flops / (CARD.peak_flops["bf16"] * _fraction("gemm", flops))
    moved = 2.0 * (m * k + k * n + m * n)
    assert arithmetic > moved / (CARD.memory_bandwidth * _fraction("memory", moved))
    assert _device_us(prof, "aten::mm") == pytest.approx(arithmetic * 1e6, abs=1e-3)


def test_element_wise_operators_take_their_bytes_at_the_memory_bandwidth():
    x, y = torch.randn(1 << 20, device="supa"), torch.randn(1 << 20, device="supa")
    with profile(activities=DEVICE) as prof:
        x + y
        x.mul_(2.0)
    added = 3.0 * 4 * (1 << 20)  # two operands read, one result written
    scaled = 2.0 * 4 * (1 << 20)  # in place: read and written once
    for name, moved in (("aten::add", added), ("aten::mul_", scaled)):
        expected = moved / (CARD.memory_bandwidth * _fraction("memory", moved))
        assert _device_us(prof, name) == pytest.approx(expected * 1e6, abs=1e-3), name


def test_a_copy_to_the_host_takes_the_host_link():
    x = torch.randn(1 << 18, device="supa")
    with profile(activities=DEVICE) as prof:
        x.cpu()
    (copy,) = _card_events(prof)
    assert copy.name == "card:Memcpy DtoH"
    expected = 4.0 * (1 << 18) / (CARD.host_link_bandwidth * efficiency.HOST_LINK_EFFICIENCY)
    assert copy.time_range.elapsed_us() == pytest.approx(expected * 1e6, abs=1e-3)


def test_views_and_allocations_launch_nothing_on_the_card():
    x = torch.randn(64, 64, device="supa")
    with profile(activities=DEVICE) as prof:
        x.view(-1).unsqueeze(0).t()
        torch.empty(128, device="supa")
    assert _card_events(prof) == []


def test_each_kernel_counts_as_its_operators_device_time_and_its_callers():
    a, b = torch.randn(256, 256, device="supa"), torch.randn(256, 256, device="supa")
    with profile(activities=DEVICE) as prof:
        torch.nn.functional.linear(a, b)
    rows = {row.key: row for row in prof.key_averages()}
    (kernel,) = _card_events(prof)
    launcher = next(name for name in ("aten::mm", "aten::addmm", "aten::matmul") if name in rows
                    and rows[name].self_device_time_total > 0)
    assert rows[launcher].self_device_time_total == pytest.approx(kernel.time_range.elapsed_us())
    assert rows["aten::linear"].self_device_time_total == 0
    assert rows["aten::linear"].device_time_total == pytest.approx(kernel.time_range.elapsed_us())


def test_the_chrome_trace_has_a_track_for_the_card(tmp_path):
    x = torch.randn(1024, 1024, device="supa")
    with profile(activities=DEVICE) as prof:
        x @ x
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert [e["name"] for e in kernels] == ["card:aten::mm"]
    (kernel,) = kernels
    assert kernel["dur"] == pytest.approx(_device_us(prof, "aten::mm"), abs=1e-3)
    assert kernel["args"]["card"] == "BR100" and int(kernel["args"]["FLOPs"]) == 2 * 1024 ** 3
    names = [e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"
             and e["pid"] == kernel["pid"]]
    assert names == ["SUPA 0 (modelled: BR100)"]
    host = [e for e in events if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    assert len(host) == 1 and host[0]["pid"] != kernel["pid"]


def _profile_cuda_activity():
    if ProfilerActivity.CUDA != ProfilerActivity.PrivateUse1:
        pytest.skip("transfer_to_supa is off: the CUDA activity is CUDA's")
    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


@pytest.mark.parametrize("start", [_profile_cuda_activity,
                                   lambda: torch.autograd.profiler.profile(use_device="supa", use_kineto=True)],
                         ids=["cuda-activity-under-the-transfer", "autograd-profiler-with-kineto"])
def test_the_other_ways_of_asking_for_the_device_get_the_card_track(start):
    a = torch.randn(512, 512, device="supa")
    with start() as prof:
        a @ a
    (kernel,) = _card_events(prof)
    assert kernel.name == "card:aten::mm"
    assert kernel.time_range.elapsed_us() > 0
    assert _device_us(prof, "aten::mm") == pytest.approx(kernel.time_range.elapsed_us())


def _legacy_cuda():
    if ProfilerActivity.CUDA != ProfilerActivity.PrivateUse1:
        pytest.skip("transfer_to_supa is off: use_cuda means CUDA")
    return torch.autograd.profiler.profile(use_device="cuda")


@pytest.mark.parametrize("start", [lambda: torch.autograd.profiler.profile(use_device="supa"), _legacy_cuda],
                         ids=["use-device-supa", "use-cuda-under-the-transfer"])
def test_the_profiler_without_kineto_reads_the_card_time_in_whole_microseconds(start):
    # PyTorch asks the backend's event stubs for each operator's device time and keeps whole microseconds.
    m = 1024
    a = torch.randn(m, m, device="supa")
    with start() as prof:
        a @ a
        a + a
    matmul = 2.0 * m ** 3 / (CARD.peak_flops["fp32"] * _fraction("gemm", 2.0 * m ** 3))
    added = 3.0 * 4 * m * m
    add = added / (CARD.memory_bandwidth * _fraction("memory", added))
    assert _device_us(prof, "aten::mm") == int(matmul * 1e6)
    assert _device_us(prof, "aten::add") == int(add * 1e6)
    assert _device_us(prof, "aten::matmul") == 0  # its kernel is its aten::mm's


def test_profiling_the_host_alone_is_unchanged():
    a = torch.randn(256, 256, device="supa")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a @ a
    assert _card_events(prof) == []
    assert {"aten::matmul", "aten::mm"} <= {row.key for row in prof.key_averages()}
    assert all(row.device_time_total == 0 for row in prof.key_averages())


def test_the_card_is_chosen_by_name_or_profile_file(monkeypatch, tmp_path):
    monkeypatch.setenv("SUPA_EMU_PROFILE", "BR104")
    monkeypatch.delenv("SUPA_EMU_PROFILER_CARD", raising=False)
    assert config.load().profiler_card == card_profiles.PROFILES["BR104"]
    monkeypatch.setenv("SUPA_EMU_PROFILER_CARD", "h200")
    assert config.load().profiler_card == card_profiles.PROFILES["H200"]
    monkeypatch.setenv("SUPA_EMU_PROFILER_CARD", "BR200")
    with pytest.raises(config.ConfigError, match="SUPA_EMU_PROFILER_CARD='BR200' is unknown; accepted values: BR100"):
        config.load()
    bad = tmp_path / "card.toml"
    bad.write_text('name = "mine"\n')
    monkeypatch.setenv("SUPA_EMU_PROFILER_CARD", str(bad))
    with pytest.raises(config.ConfigError, match="SUPA_EMU_PROFILER_CARD: .*card.toml: field .* is missing"):
        config.load()
