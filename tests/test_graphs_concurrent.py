"""Graph replays launched on busy streams run concurrently, as on a card: queued on their stream and
run kernel by kernel, one kernel of each stream in turn, at the first point that observes card
memory or orders work (docs/device_model.md#replays-on-busy-streams-run-concurrently)."""

import threading

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

pytestmark = pytest.mark.usefixtures("supa_initialised")

SIZE = 1000
# Keeps a stream busy well past the few calls that launch the replays, even on a loaded host.
BUSY_CYCLES = 100_000_000


def func_with_temps(t, val):
    x = t.clone() + val
    y = t.clone() + val
    return x + y


def capture_pair(pool_of_second):
    """Two graphs as PyTorch's test_graph_concurrent_replay captures them; the second shares the
    first's pool when `pool_of_second` says so."""
    a = torch.ones(SIZE, device="supa")
    g0, g1 = torch.supa.SUPAGraph(), torch.supa.SUPAGraph()
    s = torch.supa.Stream()
    s.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(s):
        g0.capture_begin()
        b = a.clone()
        for _ in range(5):
            b = func_with_temps(b, 1)
        g0.capture_end()
        g1.capture_begin(*pool_of_second(g0))
        c = a.clone()
        for _ in range(5):
            c = func_with_temps(c, 2)
        g1.capture_end()
    return g0, g1, b, c


def replay_side_by_side(g0, g1):
    """As the PyTorch test: s1 waits for s0's sleep, so both replays start together."""
    s0, s1 = torch.supa.Stream(), torch.supa.Stream()
    torch.supa.synchronize()
    with torch.supa.stream(s0):
        torch.supa._sleep(BUSY_CYCLES)
        s1.wait_stream(s0)
        g0.replay()
    with torch.supa.stream(s1):
        g1.replay()
    torch.supa.current_stream().wait_stream(s0)
    torch.supa.current_stream().wait_stream(s1)


@pytest.mark.parametrize("pool_of_second", [lambda g0: (g0.pool(),), lambda g0: ()], ids=["shared", "own"])
def test_concurrent_replays_of_graphs_sharing_a_pool_mix_their_temporaries(pool_of_second):
    g0, g1, b, c = capture_pair(pool_of_second)
    replay_side_by_side(g0, g1)
    shared = pool_of_second(g0) != ()
    # Each graph's temporaries are the other's when they share a pool: running at once, they
    # overwrite each other's, as on a card; with a pool each, the results are right.
    assert (b.sum().item() != SIZE * 94) == shared
    assert (c.sum().item() != SIZE * 156) == shared
    # Replayed one after the other, the shared pool does no harm.
    g0.replay()
    g1.replay()
    assert b.sum().item() == SIZE * 94 and c.sum().item() == SIZE * 156


def capture_increment(x):
    g = torch.supa.SUPAGraph()
    s = torch.supa.Stream()
    s.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(s):
        g.capture_begin()
        x += 1
        g.capture_end()
    torch.supa.current_stream().wait_stream(s)
    return g


def test_replays_queued_on_one_stream_run_in_launch_order():
    x = torch.zeros(4, device="supa")
    g = capture_increment(x)
    doubled = torch.supa.SUPAGraph()
    s = torch.supa.Stream()
    with torch.supa.stream(s):
        doubled.capture_begin()
        y = x * 2
        doubled.capture_end()
    with torch.supa.stream(s):
        torch.supa._sleep(BUSY_CYCLES)
        g.replay()
        g.replay()
        doubled.replay()  # after both increments, on the same stream
    assert not s.query()  # a query runs the queued replays; the sleep still runs
    assert y.tolist() == [4.0] * 4 and x.tolist() == [2.0] * 4


def test_a_stream_that_waits_on_an_event_sees_the_work_before_it():
    x = torch.zeros(4, device="supa")
    g = capture_increment(x)
    s0, s1 = torch.supa.Stream(), torch.supa.Stream()
    with torch.supa.stream(s0):
        torch.supa._sleep(BUSY_CYCLES)
        g.replay()
        done = torch.supa.Event()
        done.record()  # orders work: the replay runs before the event
    with torch.supa.stream(s1):
        s1.wait_event(done)
        z = x + 10
    assert z.tolist() == [11.0] * 4


def test_deleting_a_graph_runs_its_queued_replay_first():
    x = torch.zeros(4, device="supa")
    g = capture_increment(x)
    s = torch.supa.Stream()
    with torch.supa.stream(s):
        torch.supa._sleep(BUSY_CYCLES)
        g.replay()
    del g  # the queued replay must not outlive the graph it reads
    torch.supa.synchronize()
    assert x.tolist() == [1.0] * 4


def test_another_thread_observing_runs_the_queued_replays_and_matrix_products_run_alongside():
    x = torch.zeros(4, device="supa")
    g = capture_increment(x)
    s = torch.supa.Stream()
    seen, errors = [], []
    m = torch.randn(64, 64, device="supa")

    def products():
        try:
            for _ in range(20):
                (m @ m).sum().item()
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    workers = [threading.Thread(target=products) for _ in range(2)]
    for w in workers:
        w.start()
    for _ in range(5):
        with torch.supa.stream(s):
            torch.supa._sleep(BUSY_CYCLES // 10)
            g.replay()
    def read():
        torch.supa.current_stream().wait_stream(s)
        seen.append(x.sum().item())

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    for w in workers:
        w.join()
    assert not errors
    assert seen == [20.0] and x.tolist() == [5.0] * 4
