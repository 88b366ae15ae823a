"""torch.supa graphs: capture, replay, pools, the graph context manager, make_graphed_callables."""

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")


@pytest.fixture(autouse=True)
def initialised():
    torch.supa.init()


def test_capture_and_replay_reads_current_inputs():
    x = torch.ones(4, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        y = x * 2 + 1
    g.replay()
    assert torch.equal(y.cpu(), torch.full((4,), 3.0))
    x.copy_(torch.full((4,), 5.0))
    g.replay()
    assert torch.equal(y.cpu(), torch.full((4,), 11.0))


def test_replay_repeats_in_place_ops():
    acc = torch.zeros(3, device="supa")
    step = torch.ones(3, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        acc.add_(step)
    start = acc.clone()
    for _ in range(3):
        g.replay()
    assert torch.equal((acc - start).cpu(), torch.full((3,), 3.0))


def test_capture_begin_end_explicitly_on_side_stream():
    x = torch.arange(4, dtype=torch.float32, device="supa")
    g = torch.supa.SUPAGraph()
    s = torch.supa.Stream()
    torch.supa.synchronize()
    with torch.supa.stream(s):
        g.capture_begin()
        assert torch.supa.is_current_stream_capturing()
        y = x.mul(3)
        g.capture_end()
    assert not torch.supa.is_current_stream_capturing()
    x.fill_(2.0)
    g.replay()
    assert torch.equal(y.cpu(), torch.full((4,), 6.0))


def test_bad_capture_error_mode_is_rejected():
    g = torch.supa.SUPAGraph()
    with pytest.raises(RuntimeError, match="Unknown capture error mode. Expected `global`, `thread_local`, "
                                           "or `relaxed`, got bogus"):
        g.capture_begin(capture_error_mode="bogus")


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_error_modes_accepted(mode):
    x = torch.ones(2, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g, capture_error_mode=mode):
        y = x + 1
    g.replay()
    assert torch.equal(y.cpu(), torch.full((2,), 2.0))


def test_graph_context_attributes_and_pool_sharing():
    g1 = torch.supa.SUPAGraph()
    ctx = torch.supa.graph(g1)
    assert isinstance(torch.supa.graph.default_capture_stream, torch.supa.Stream)
    assert ctx.capture_stream is torch.supa.graph.default_capture_stream
    assert ctx.capture_stream != torch.supa.default_stream()  # capture never uses the default stream
    # Every graph context without an explicit stream shares the one default capture stream.
    assert torch.supa.graph(torch.supa.SUPAGraph()).capture_stream is ctx.capture_stream
    assert ctx.pool == ()
    x = torch.ones(2, device="supa")
    with ctx:
        y1 = x + 1
    handle = torch.supa.graph_pool_handle()
    assert isinstance(handle, tuple) and len(handle) == 2
    g2 = torch.supa.SUPAGraph()
    with torch.supa.graph(g2, pool=g1.pool()):
        y2 = y1 * 2
    x.fill_(4.0)
    g1.replay()
    g2.replay()
    assert torch.equal(y2.cpu(), torch.full((2,), 10.0))


def test_graph_pools_come_from_one_counter_and_own_the_captured_blocks():
    x = torch.ones(1000, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        y = x + 1
    handle = torch.supa.graph_pool_handle()
    # Graph pools are (n, 0); handles and the pools of graphs captured without one are
    # numbered by the same counter, so they never collide.
    assert g.pool()[1] == 0 and handle[1] == 0
    assert handle[0] > g.pool()[0] > 0
    def segment_of_block():  # blocks are slices of their segments
        return {block["address"]: seg for seg in torch.supa.memory_snapshot() for block in seg["blocks"]}

    segments = segment_of_block()
    assert tuple(segments[y.data_ptr()]["segment_pool_id"]) == g.pool()
    assert tuple(segments[x.data_ptr()]["segment_pool_id"]) == (0, 0)
    after = torch.empty(1000, device="supa")  # capture over: back to the general pool
    assert tuple(segment_of_block()[after.data_ptr()]["segment_pool_id"]) == (0, 0)


def test_reset_allows_recapture():
    x = torch.ones(2, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        y = x + 1
    g.replay()
    g.reset()
    with torch.supa.graph(g):
        z = x * 5
    x.fill_(2.0)
    g.replay()
    assert torch.equal(z.cpu(), torch.full((2,), 10.0))
    assert torch.equal(y.cpu(), torch.full((2,), 2.0))  # not re-run after reset


def test_make_graphed_callables_function_forward_and_backward():
    w = torch.randn(4, 3, device="supa", requires_grad=True)

    def fn(inp):
        return (inp @ w).relu().sum(dim=1)

    sample = torch.randn(5, 4, device="supa", requires_grad=True)
    graphed = torch.supa.make_graphed_callables(fn, (sample,), num_warmup_iters=1)

    inp = torch.randn(5, 4, device="supa", requires_grad=True)
    out = graphed(inp)
    ref_inp = inp.detach().cpu().requires_grad_()
    ref_w = w.detach().cpu().requires_grad_()
    ref = (ref_inp @ ref_w).relu().sum(dim=1)
    torch.testing.assert_close(out.cpu(), ref.detach())
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(inp.grad.cpu(), ref_inp.grad)


def test_make_graphed_callables_module_uses_graph_in_captured_mode_only():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh()).to("supa")
    sample = torch.randn(2, 3, device="supa")
    graphed = torch.supa.make_graphed_callables(model, (sample,), num_warmup_iters=1)
    assert graphed is model
    x = torch.randn(2, 3, device="supa")
    cpu_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    torch.testing.assert_close(graphed(x).cpu(), cpu_model(x.cpu()))
    model.eval()
    torch.testing.assert_close(graphed(x).cpu(), cpu_model(x.cpu()))


def test_make_graphed_callables_rejects_hooks_and_autocast_cache():
    model = torch.nn.Linear(2, 2).to("supa")
    model.register_forward_hook(lambda *a: None)
    with pytest.raises(AssertionError):
        torch.supa.make_graphed_callables(model, (torch.randn(1, 2, device="supa"),))
    plain = torch.nn.Linear(2, 2).to("supa")
    sample = torch.randn(1, 2, device="supa")
    with torch.autocast("supa", cache_enabled=True):
        with pytest.raises(RuntimeError, match="make_graphed_callables does not support the autocast caching"):
            torch.supa.make_graphed_callables(plain, (sample,))


# Graph-safe RNG: a captured random call keeps its place in the graph's counter range; each replay
# starts that range at the generator's offset of the moment and advances the generator past it.
def _eager_draws(offset, generator=None):
    generator = generator or torch.supa.default_generators[torch.supa.current_device()]
    generator.set_offset(offset)
    return (torch.rand(6, device="supa", generator=generator).cpu(),
            torch.randn(5, device="supa", generator=generator).cpu())


def test_replays_draw_fresh_numbers_from_the_generators_offset():
    torch.supa.manual_seed(3)
    gen = torch.supa.default_generators[torch.supa.current_device()]
    uniform, normal = torch.empty(6, device="supa"), torch.empty(5, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        uniform.uniform_()
        normal.normal_()
    assert gen.get_offset() == 0  # capturing reserves counters in the graph, not in the generator
    replays = []
    for _ in range(2):
        g.replay()
        replays.append((uniform.cpu(), normal.cpu()))
    assert gen.get_offset() == 2 * (8 + 8)
    for offset, (u, n) in zip((0, 16), replays):
        eager_u, eager_n = _eager_draws(offset)
        assert torch.equal(u, eager_u) and torch.equal(n, eager_n)


def test_replay_reads_the_seed_of_the_moment():
    out = torch.empty(8, device="supa")
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        out.uniform_()
    torch.supa.manual_seed(42)
    g.replay()
    torch.supa.manual_seed(42)
    assert torch.equal(out.cpu(), torch.rand(8, device="supa").cpu())


def test_registered_generator_is_graph_safe():
    gen = torch.Generator(device="supa")
    gen.manual_seed(9)
    out = torch.empty(6, device="supa")
    g = torch.supa.SUPAGraph()
    g.register_generator_state(gen)
    with torch.supa.graph(g):
        out.uniform_(generator=gen)
    g.replay()
    assert gen.get_offset() == 8
    check = torch.Generator(device="supa")
    check.manual_seed(9)
    assert torch.equal(out.cpu(), torch.rand(6, device="supa", generator=check).cpu())


def test_unregistered_generator_under_capture_raises():
    gen = torch.Generator(device="supa")
    g = torch.supa.SUPAGraph()
    with pytest.raises(RuntimeError, match="Attempt to increase offset for a SUPA generator not in capture mode"):
        with torch.supa.graph(g):
            torch.rand(4, device="supa", generator=gen)
    torch.rand(4, device="supa", generator=gen)  # usable again after the failed capture
    assert gen.get_offset() == 4


def test_register_generator_state_during_capture_raises():
    g, other = torch.supa.SUPAGraph(), torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        with pytest.raises(RuntimeError, match="Cannot register the state during capturing stage"):
            other.register_generator_state(torch.Generator(device="supa"))


def test_graphed_dropout_masks_differ_per_replay():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).to("supa")
    graphed = torch.supa.make_graphed_callables(model, (torch.randn(4, 16, device="supa"),), num_warmup_iters=1)
    x = torch.randn(4, 16, device="supa")
    first, second = graphed(x).detach().cpu(), graphed(x).detach().cpu()
    assert not torch.equal(first == 0, second == 0)


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


# ---------------------------------------------------------------------------------------------
# Captured training steps equal eager ones.

_CAPTURABLE = [
    (torch.optim.Adam, {"capturable": True}), (torch.optim.Adam, {"capturable": True, "foreach": False}),
    (torch.optim.Adam, {"fused": True}), (torch.optim.AdamW, {"capturable": True, "amsgrad": True}),
    (torch.optim.AdamW, {"fused": True}), (torch.optim.SGD, {"momentum": 0.9}),
    (torch.optim.SGD, {"momentum": 0.9, "fused": True}), (torch.optim.Adagrad, {"fused": True}),
    (torch.optim.NAdam, {"capturable": True}), (torch.optim.RAdam, {"capturable": True}),
    (torch.optim.Adamax, {"capturable": True}), (torch.optim.ASGD, {"capturable": True}),
    (torch.optim.RMSprop, {"capturable": True, "momentum": 0.5}), (torch.optim.Adadelta, {"capturable": True}),
]


@pytest.mark.parametrize("opt_class,kwargs", _CAPTURABLE,
                         ids=[f"{c.__name__}-{'-'.join(k)}" for c, k in _CAPTURABLE])
def test_captured_optimizer_step_equals_eager(opt_class, kwargs):
    steps = 5
    torch.manual_seed(0)
    params = [torch.randn(6, 5, device="supa") for _ in range(2)]
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps)]
    eager_params = [p.clone().requires_grad_() for p in params]
    eager = opt_class(eager_params, lr=0.1, **kwargs)
    for step_grads in grads:
        for p, g in zip(eager_params, step_grads):
            p.grad = g.clone()
        eager.step()

    # The graphed run: two eager steps create the optimizer's state, the capture changes nothing,
    # then each replay is one step.
    graphed_params = [p.clone().requires_grad_() for p in params]
    opt = opt_class(graphed_params, lr=0.1, **kwargs)
    for step_grads in grads[:2]:
        for p, grad in zip(graphed_params, step_grads):
            p.grad = grad.clone()
        opt.step()
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        opt.step()
    for step_grads in grads[2:]:
        for p, grad in zip(graphed_params, step_grads):
            p.grad.copy_(grad)
        g.replay()
    for a, b in zip(eager_params, graphed_params):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu())
    state = next(iter(opt.state.values()))
    if "step" in state:
        assert int(state["step"]) == steps


@pytest.mark.parametrize("fused", [False, True])
def test_captured_scaled_backward_with_grad_scaler_equals_eager(fused):
    inputs = [torch.full((1,), v, device="supa") for v in (4.0, float("inf"), 2.0, 1.0)]

    def run(graphed):
        weight = torch.ones(1, device="supa", requires_grad=True)
        opt = torch.optim.SGD([weight], lr=0.1, fused=fused)
        scaler = torch.amp.GradScaler("supa", init_scale=4.0)
        static_input = torch.ones_like(weight)
        if graphed:
            s = torch.supa.Stream()
            with torch.supa.stream(s):  # warm-up: autograd's and the scaler's state
                scaler.scale(weight * static_input).backward()
            opt.zero_grad(set_to_none=False)
            g = torch.supa.SUPAGraph()
            with torch.supa.graph(g):
                scaler.scale(weight * static_input).backward()
        scales = []
        for value in inputs:
            static_input.copy_(value)
            if graphed:
                g.replay()
            else:
                scaler.scale(weight * static_input).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=False)
            scales.append(scaler.get_scale())
        return weight.detach().cpu(), scales

    eager_weight, eager_scales = run(False)
    graphed_weight, graphed_scales = run(True)
    torch.testing.assert_close(graphed_weight, eager_weight)
    assert graphed_scales == eager_scales


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


def test_checkpoint_preserving_the_rng_state_under_capture_equals_eager():
    def fn(x):
        return x * torch.sigmoid(torch.randn(1, device="supa"))

    torch.supa.manual_seed(42)
    eager_in = torch.ones(1, device="supa", requires_grad=True)
    eager_out = torch.utils.checkpoint.checkpoint(fn, eager_in, use_reentrant=False, preserve_rng_state=True)
    (eager_grad,) = torch.autograd.grad(eager_out, eager_in)
    g = torch.supa.SUPAGraph()
    with torch.supa.graph(g):
        graph_in = torch.ones(1, device="supa", requires_grad=True)
        graph_out = torch.utils.checkpoint.checkpoint(fn, graph_in, use_reentrant=False, preserve_rng_state=True)
        (graph_grad,) = torch.autograd.grad(graph_out, graph_in)
    torch.supa.manual_seed(42)
    g.replay()
    assert torch.equal(graph_grad.cpu(), eager_grad.cpu())


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
