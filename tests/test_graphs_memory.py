"""torch.supa graphs' card memory: a graph's private pool, as a card's allocator keeps it, and the
blocks a graph holds for its generator states."""

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

pytestmark = pytest.mark.usefixtures("supa_initialised")


# ---------------------------------------------------------------------------------------------
# A graph's private pool, as a card's allocator keeps it.

def test_a_graph_holds_its_pools_memory_by_address_only():
    # Freed after capture, a block goes back to the graph's pool, where a later capture that shares
    # the pool takes it: replaying the graphs out of order then mixes their results, as on a card.
    s = torch.supa.Stream()
    a = torch.ones(1000, device="supa")
    g0, g1, g2 = torch.supa.SUPAGraph(), torch.supa.SUPAGraph(), torch.supa.SUPAGraph()
    with torch.supa.stream(s):
        g0.capture_begin()
        b = a.clone()
        c = b + 1
        d = b + 2
        g0.capture_end()
        g1.capture_begin(g0.pool())
        e = c + 3
        del c
        g1.capture_end()
        g2.capture_begin(g0.pool())
        f = d + 4
        g2.capture_end()
    for g in (g0, g1, g2):
        g.replay()
    assert e.sum().item() == 5000 and f.sum().item() == 7000
    for g in (g0, g2, g1):
        g.replay()
    assert e.sum().item() == 10000  # g2's f took c's block, and g1 read f + 3 as its c + 3


def test_a_graphs_pool_keeps_its_segments_while_the_graph_lives():
    def pool_bytes(pool):
        return sum(seg["total_size"] for seg in torch.supa.memory_snapshot()
                   if tuple(seg["segment_pool_id"]) == tuple(pool))

    s = torch.supa.Stream()
    a = torch.ones(1 << 18, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.stream(s):
        g.capture_begin()
        tmp = a * 2
        out = tmp + 1
        del tmp
        g.capture_end()
    pool = g.pool()
    in_graph = pool_bytes(pool)
    assert in_graph > 0
    torch.supa.empty_cache()
    assert pool_bytes(pool) == in_graph  # tmp's free block stays in the live graph's pool
    g.replay()
    assert torch.equal(out.cpu(), torch.full((1 << 18,), 3.0))
    del g, out
    torch.supa.empty_cache()
    assert pool_bytes(pool) == 0


def test_a_graph_holds_two_card_blocks_per_generator_state_while_it_lives():
    def active_blocks():
        return torch.supa.memory_stats()["active.all.current"]

    before = active_blocks()
    states = [torch.supa.default_generators[0].graphsafe_get_state(),
              torch.supa.default_generators[0].clone_state()]
    g = torch.supa.SUPAGraph()
    for state in states:
        g.register_generator_state(state)
    s = torch.supa.Stream()
    with torch.supa.stream(s):
        g.capture_begin()
        torch.rand(1, device="supa")
        g.capture_end()
    g.replay()
    assert active_blocks() - before == 2 * len(states)  # each state's seed and offset on the card
    del g
    assert active_blocks() == before
