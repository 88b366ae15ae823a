"""torch.supa graphs under capture: a capture records and does not run, what a card refuses under capture
is refused, and which streams a capture holds."""

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

pytestmark = pytest.mark.usefixtures("supa_initialised")


# ---------------------------------------------------------------------------------------------
# Capture records, it does not run; what a card refuses under capture is refused.

def test_capture_changes_nothing_until_replay():
    x = torch.zeros(3, device="supa")
    buf = torch.zeros(3, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        x += 1
        buf.copy_(x)
    assert torch.equal(x.cpu(), torch.zeros(3)) and torch.equal(buf.cpu(), torch.zeros(3))
    g.replay()
    g.replay()
    assert torch.equal(x.cpu(), torch.full((3,), 2.0)) and torch.equal(buf.cpu(), torch.full((3,), 2.0))


def test_captured_random_calls_leave_their_operands_until_replay():
    x = torch.zeros(1000, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        x.uniform_()
    assert torch.count_nonzero(x).item() == 0
    g.replay()
    assert torch.count_nonzero(x).item() == 1000


def test_work_on_another_stream_during_capture_runs_at_once():
    x = torch.ones(2, device="supa")
    other = torch.supa.Stream()
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        y = x * 3
        with torch.supa.stream(other):
            assert not torch.supa.is_current_stream_capturing()
            z = x + 1
    assert torch.equal(z.cpu(), torch.full((2,), 2.0))
    g.replay()
    assert torch.equal(y.cpu(), torch.full((2,), 3.0))


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: t.nonzero(), lambda t: t[t > 0]],
                         ids=["item", "nonzero", "mask"])
def test_reading_values_under_capture_is_refused_and_invalidates_the_capture(read):
    x = torch.ones(4, device="supa")
    g = torch.supa.SUPAGraph()
    s = torch.supa.Stream()
    with torch.supa.stream(s):
        g.capture_begin()
        with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
            read(x)
        with pytest.raises(RuntimeError, match="operation failed due to a previous error during capture"):
            g.capture_end()
    assert not torch.supa.is_current_stream_capturing()


@pytest.mark.parametrize("to_card", [True, False], ids=["to_card", "to_host"])
def test_copies_with_pageable_host_memory_are_refused_and_the_capture_goes_on(to_card):
    dev = torch.zeros(8, device="supa")
    host = torch.empty(8)
    g = torch.supa.SUPAGraph()
    with pytest.raises(RuntimeError, match="Cannot copy between CPU and SUPA tensors during SUPA graph capture "
                                           "unless the CPU tensor is pinned"):
        with torch.supa.graph(g):
            dev.add_(1)
            (dev.copy_(host, non_blocking=True) if to_card else host.copy_(dev, non_blocking=True))
    g.replay()  # the capture ended normally with what it recorded before the refusal
    assert torch.equal(dev.cpu(), torch.ones(8))


def test_captured_lstm_with_dropout_replays():
    model = torch.nn.LSTM(16, 16, 2, dropout=0.5).to("supa")
    x = torch.ones(5, 3, 16, device="supa")
    model(x)
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        out, _ = model(x)
    g.replay()
    assert out.shape == (5, 3, 16) and torch.isfinite(out).all()


def test_copies_with_pinned_host_memory_are_captured():
    host = torch.arange(4, dtype=torch.float32).pin_memory()
    out = torch.zeros(4).pin_memory()
    dev = torch.zeros(4, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        dev.copy_(host, non_blocking=True)
        dev.mul_(2)
        out.copy_(dev, non_blocking=True)
    assert torch.equal(out, torch.zeros(4))
    g.replay()
    torch.supa.synchronize()
    assert torch.equal(out, torch.arange(4, dtype=torch.float32) * 2)


def test_capture_on_the_default_stream_is_refused():
    g = torch.supa.SUPAGraph()
    with pytest.raises(RuntimeError, match="SUPA graphs must be captured on a non-default stream"):
        g.capture_begin()
    assert not torch.supa.is_current_stream_capturing()


def test_empty_capture_warns():
    g = torch.supa.SUPAGraph()
    with pytest.warns(UserWarning, match="The SUPA Graph is empty"):
        with torch.supa.graph(g):
            pass


def test_instantiate_only_with_keep_graph():
    x = torch.ones(2, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        x.add_(1)
    with pytest.raises(RuntimeError, match="only when keep_graph=true"):
        g.instantiate()
    kept = torch.supa.SUPAGraph(keep_graph=True)
    with torch.supa.graph(kept):
        x.add_(1)
    kept.instantiate()
    kept.replay()
    assert torch.equal(x.cpu(), torch.full((2,), 2.0))


def test_replay_while_other_threads_compute():
    import threading

    x = torch.randn(64, 64, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        y = x @ x
    expected = (x.cpu() @ x.cpu())
    errors = []

    def work():
        try:
            a = torch.randn(128, 128, device="supa")
            for _ in range(20):
                a = (a @ a.t()).tanh()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(20):
        g.replay()
    for t in threads:
        t.join()
    assert not errors
    torch.testing.assert_close(y.cpu(), expected)


def test_a_stream_that_waits_on_the_capturing_stream_joins_the_capture():
    x = torch.ones(4, device="supa")
    g = torch.supa.SUPAGraph()
    s0, s1 = torch.supa.Stream(), torch.supa.Stream()
    with torch.supa.stream(s0):
        g.capture_begin()
        y = x + 1
    with torch.supa.stream(s1):
        s1.wait_stream(s0)
        assert torch.supa.is_current_stream_capturing()
        z = y * 2
    s0.wait_stream(s1)
    with torch.supa.stream(s0):
        g.capture_end()
    pools = {tuple(seg["segment_pool_id"]) for seg in torch.supa.memory_snapshot()
             for block in seg["blocks"] if block["state"] == "active_allocated"}
    assert g.pool() in pools
    g.replay()
    assert torch.equal(z.cpu(), torch.full((4,), 4.0))


def test_stream_is_capturing_asks_about_the_stream_given():
    g = torch.supa.SUPAGraph()
    s0, s1, other = torch.supa.Stream(), torch.supa.Stream(), torch.supa.Stream()
    with torch.supa.stream(s0):
        g.capture_begin()
        torch.ones(1, device="supa").add_(1)
    try:
        s1.wait_stream(s0)  # s1 joins the capture; `other` does not; the current stream is not captured
        assert s0.is_capturing() and s1.is_capturing() and not other.is_capturing()
        assert not torch.supa.current_stream().is_capturing()
    finally:
        s0.wait_stream(s1)
        with torch.supa.stream(s0):
            g.capture_end()
    assert not s0.is_capturing() and not s1.is_capturing()
