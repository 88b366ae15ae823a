"""torch.supa graphs: capture, replay, pools, the graph context manager, make_graphed_callables,
graph-safe random numbers, captured training steps (capture rules: test_graphs_capture.py; a graph's
memory: test_graphs_memory.py)."""

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

pytestmark = pytest.mark.usefixtures("supa_initialised")


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
