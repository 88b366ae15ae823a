"""The card's random numbers: the generator's Philox state (seed, offset, as CUDA's) and the random
operators drawn from it (see test_random.py for how they make a sharded init equal the unsharded one).
Values differ from the CPU's, as on a card: the operator tests check distributions, determinism per seed
and independence of device and sharding.
"""

import io
import math

import pytest
from harness import fresh_process
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")


multi_device = pytest.mark.skipif(torch.supa.device_count() < 2, reason="needs two SUPA devices")


@pytest.fixture(autouse=True)
def initialised():
    torch.supa.init()


# ------------------------------------------------------------------------------------------------
# The generator's state: Philox (seed, offset), as CUDA's
# ------------------------------------------------------------------------------------------------
_MASK32 = 0xFFFFFFFF


def _philox4x32_10(counter, key):
    """Philox4x32-10 (Salmon et al., SC 2011) in plain Python: the independent reference."""
    c, (k0, k1) = list(counter), key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> 32) ^ c[3] ^ k1) & _MASK32, p0 & _MASK32]
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c


def _word(seed, offset, i, draw=0):
    """The 32-bit word element i of a call at `offset` reads for its `draw`-th value."""
    group = offset // 4 + i // 4
    return _philox4x32_10([group & _MASK32, group >> 32, draw, 0], [seed & _MASK32, seed >> 32])[i % 4]


def _state(device=None):
    """(seed, offset) of the device's generator, read from get_rng_state's 16 bytes."""
    state = torch.supa.get_rng_state() if device is None else torch.supa.get_rng_state(device)
    seed, offset = state.view(torch.int64).tolist()
    return seed % (1 << 64), offset


def test_reference_philox_matches_published_test_vectors():
    # Known-answer vectors of Random123's philox4x32_10 (kat_vectors).
    assert _philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert _philox4x32_10([_MASK32] * 4, [_MASK32] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_state_is_16_bytes_of_seed_and_offset():
    torch.supa.manual_seed(2**63 + 5)
    state = torch.supa.get_rng_state()
    assert state.dtype == torch.uint8 and state.shape == (16,)
    assert _state() == (2**63 + 5, 0)
    assert torch.supa.default_generators[torch.supa.current_device()].get_offset() == 0


def test_offsets_advance_by_elements_rounded_up_to_4():
    torch.supa.manual_seed(1)
    torch.rand(10, device="supa")
    assert _state()[1] == 12
    torch.randn(4, device="supa")
    assert _state()[1] == 16
    torch.randint(0, 5, (1,), device="supa")
    assert _state()[1] == 20


def test_uniform_values_are_the_philox_words_of_their_counters():
    seed, offset = 0x123456789ABCDEF0, 40
    gen = torch.Generator(device="supa")
    gen.manual_seed(seed)
    gen.set_offset(offset)
    values = torch.rand(11, device="supa", generator=gen).cpu().tolist()
    assert values == [(_word(seed, offset, i) >> 8) / 2**24 for i in range(11)]
    assert gen.get_offset() == offset + 12


def test_double_uniforms_have_53_random_bits():
    torch.supa.manual_seed(4)
    x = torch.rand(1000, device="supa", dtype=torch.float64).cpu()
    assert not torch.equal(x * 2**24, (x * 2**24).floor())


def test_set_offset_requires_multiples_of_4():
    gen = torch.Generator(device="supa")
    gen.set_offset(64)
    assert gen.get_offset() == 64
    with pytest.raises(RuntimeError, match="offset must be a multiple of 4"):
        gen.set_offset(6)


@pytest.mark.parametrize("bad, error, message", [
    (torch.zeros(16, dtype=torch.float32), TypeError, "RNG state must be a torch.ByteTensor"),
    (torch.zeros(15, dtype=torch.uint8), RuntimeError, "RNG state is wrong size"),
    (torch.zeros(5056, dtype=torch.uint8), RuntimeError, "RNG state is wrong size"),
    (torch.zeros(32, dtype=torch.uint8)[::2], RuntimeError, "RNG state must be contiguous"),
], ids=["float32", "15_bytes", "cpu_generator_state", "strided"])
def test_set_rng_state_rejects_what_cuda_rejects(bad, error, message):
    before = torch.supa.get_rng_state()
    with pytest.raises(error, match=message):
        torch.supa.default_generators[torch.supa.current_device()].set_state(bad)
    assert torch.equal(torch.supa.get_rng_state(), before)


def test_set_rng_state_of_wrong_size_raises_through_torch_supa():
    with pytest.raises(RuntimeError, match="RNG state is wrong size"):
        torch.supa.set_rng_state(torch.zeros(5056, dtype=torch.uint8))


def test_a_state_of_only_a_seed_starts_at_offset_0():
    torch.supa.manual_seed(9)
    torch.rand(8, device="supa")
    torch.supa.set_rng_state(torch.tensor([33], dtype=torch.int64).view(torch.uint8))
    assert _state() == (33, 0)


def test_rng_state_survives_a_checkpoint():
    torch.supa.manual_seed(21)
    torch.rand(6, device="supa")
    buffer = io.BytesIO()
    torch.save({"supa": torch.supa.get_rng_state_all()}, buffer)
    expected = torch.randn(6, device="supa").cpu()
    torch.supa.manual_seed(0)
    buffer.seek(0)
    torch.supa.set_rng_state_all(torch.load(buffer)["supa"])
    assert torch.equal(torch.randn(6, device="supa").cpu(), expected)


def _draw(queue, state) -> None:
    """A child process's draw, from `state` (if any) or the state it inherited."""
    if state is not None:
        torch.supa.set_rng_state(state)
    queue.put(torch.rand(8, device="supa").cpu().tolist())


def _draw_in_child(method: str, state=None) -> list:
    import multiprocessing

    context = multiprocessing.get_context(method)
    queue = context.Queue()
    child = context.Process(target=_draw, args=(queue, state))
    child.start()
    values = queue.get(timeout=120)
    child.join()
    return values


def _generator_state_across_fork_and_spawn() -> None:
    torch.supa.manual_seed(31)
    torch.rand(3, device="supa")
    state = torch.supa.get_rng_state()
    forked = _draw_in_child("fork")
    spawned = _draw_in_child("spawn", state)
    assert forked == spawned == torch.rand(8, device="supa").cpu().tolist()


# An interpreter of its own (not `shared=`): a shared interpreter runs all its functions whenever
# one of them is asked for, so the spawned child would start in every run, the fast tier's too.
@pytest.mark.slow  # the spawned child is a fresh interpreter
def test_generator_state_carries_across_fork_and_spawn():
    fresh_process(_generator_state_across_fork_and_spawn)


def test_clone_state_copies_and_graphsafe_state_shares():
    gen = torch.Generator(device="supa")
    gen.manual_seed(3)
    copy = gen.clone_state()
    shared = gen.graphsafe_get_state()
    torch.rand(8, device="supa", generator=gen)
    assert copy.get_offset() == 0 and shared.get_offset() == 8
    other = torch.Generator(device="supa")
    other.graphsafe_set_state(copy)
    torch.rand(4, device="supa", generator=other)
    assert copy.get_offset() == 4 and gen.get_offset() == 8
    with pytest.raises(RuntimeError, match="Expected a SUPA Generator"):
        gen.graphsafe_set_state(torch.Generator())


# ------------------------------------------------------------------------------------------------
# The random operators
# ------------------------------------------------------------------------------------------------
N = 1 << 16  # samples for the distribution checks: their tolerances are about 6 standard errors


def _on(device):
    return {"device": device}


# name -> op(n elements, device, generator): one call drawing n values per element index.
OPS = {
    "uniform_": lambda n, d, g: torch.empty(n, **_on(d)).uniform_(-2, 3, generator=g),
    "rand": lambda n, d, g: torch.rand(n, generator=g, **_on(d)),
    "rand_float64": lambda n, d, g: torch.rand(n, generator=g, dtype=torch.float64, **_on(d)),
    "rand_bfloat16": lambda n, d, g: torch.rand(n, generator=g, dtype=torch.bfloat16, **_on(d)),
    "normal_": lambda n, d, g: torch.empty(n, **_on(d)).normal_(1.5, 2.0, generator=g),
    "randn_float16": lambda n, d, g: torch.randn(n, generator=g, dtype=torch.float16, **_on(d)),
    "randn_float64": lambda n, d, g: torch.randn(n, generator=g, dtype=torch.float64, **_on(d)),
    "normal_tensor_mean": lambda n, d, g: torch.normal(torch.linspace(-1, 1, n, **_on(d)), 0.5, generator=g),
    "normal_tensor_std": lambda n, d, g: torch.normal(2.0, torch.linspace(0, 1, n, **_on(d)), generator=g),
    "normal_tensor_tensor": lambda n, d, g: torch.normal(torch.zeros(n, **_on(d)), torch.ones(n, **_on(d)),
                                                         generator=g),
    "bernoulli_": lambda n, d, g: torch.empty(n, **_on(d)).bernoulli_(0.3, generator=g),
    "bernoulli_tensor": lambda n, d, g: torch.bernoulli(torch.linspace(0, 1, n, **_on(d)), generator=g),
    "random_": lambda n, d, g: torch.empty(n, dtype=torch.int64, **_on(d)).random_(generator=g),
    "random_to": lambda n, d, g: torch.empty(n, dtype=torch.int32, **_on(d)).random_(7, generator=g),
    "random_from_to": lambda n, d, g: torch.empty(n, **_on(d)).random_(-5, 5, generator=g),
    "randint": lambda n, d, g: torch.randint(10, 1000, (n,), generator=g, **_on(d)),
    "exponential_": lambda n, d, g: torch.empty(n, **_on(d)).exponential_(4.0, generator=g),
    "cauchy_": lambda n, d, g: torch.empty(n, **_on(d)).cauchy_(1.0, 0.5, generator=g),
    "log_normal_": lambda n, d, g: torch.empty(n, **_on(d)).log_normal_(0.5, 0.25, generator=g),
    "geometric_": lambda n, d, g: torch.empty(n, **_on(d)).geometric_(0.2, generator=g),
}


def _close(value, expected, tolerance):
    assert abs(value - expected) <= tolerance, f"{value} not within {tolerance} of {expected}"


def _check_distribution(name, x):
    x = x.cpu().double()
    n = x.numel()
    if name == "uniform_":
        assert x.min() >= -2 and x.max() < 3
        _close(x.mean().item(), 0.5, 6 * 5 / math.sqrt(12 * n))
        _close(x.var().item(), 25 / 12, 0.05)
    elif name.startswith("rand_"):
        assert x.min() >= 0 and x.max() < 1
        _close(x.mean().item(), 0.5, 6 / math.sqrt(12 * n) + (1e-2 if "bfloat16" in name else 0))
    elif name == "rand":
        assert x.min() >= 0 and x.max() < 1
        _close(x.mean().item(), 0.5, 6 / math.sqrt(12 * n))
        _close(x.var().item(), 1 / 12, 0.003)
    elif name == "normal_":
        _close(x.mean().item(), 1.5, 6 * 2 / math.sqrt(n))
        _close(x.std().item(), 2.0, 0.04)
    elif name.startswith("randn_") or name == "normal_tensor_tensor":
        _close(x.mean().item(), 0.0, 6 / math.sqrt(n) + 1e-3)
        _close(x.std().item(), 1.0, 0.02)
    elif name == "normal_tensor_mean":
        residual = x - torch.linspace(-1, 1, n, dtype=torch.float64)
        _close(residual.mean().item(), 0.0, 6 * 0.5 / math.sqrt(n))
        _close(residual.std().item(), 0.5, 0.01)
    elif name == "normal_tensor_std":
        std = torch.linspace(0, 1, n, dtype=torch.float64)
        assert x[0] == 2.0  # std 0: exactly the mean
        _close(((x - 2.0) / std)[1:].std().item(), 1.0, 0.02)
    elif name == "bernoulli_":
        assert set(x.unique().tolist()) == {0.0, 1.0}
        _close(x.mean().item(), 0.3, 6 * math.sqrt(0.21 / n))
    elif name == "bernoulli_tensor":
        assert x[0] == 0 and x[-1] == 1  # p = 0 and p = 1 are certain
        _close(x[: n // 2].mean().item(), 0.25, 0.02)
        _close(x[n // 2:].mean().item(), 0.75, 0.02)
    elif name == "random_":
        assert x.min() >= 0
        _close(x.mean().item() / 2**63, 0.5, 0.01)
    elif name == "random_to":
        assert set(x.unique().tolist()) == set(range(7))
        _close(x.mean().item(), 3.0, 0.05)
    elif name == "random_from_to":
        assert set(x.unique().tolist()) == set(range(-5, 5))
        _close(x.mean().item(), -0.5, 0.05)
    elif name == "randint":
        assert x.min() >= 10 and x.max() < 1000
        _close(x.mean().item(), 504.5, 6 * 990 / math.sqrt(12 * n))
    elif name == "exponential_":
        assert x.min() > 0
        _close(x.mean().item(), 0.25, 6 * 0.25 / math.sqrt(n))
    elif name == "cauchy_":
        _close(x.median().item(), 1.0, 0.02)
        _close(((x - 1).abs() < 0.5).double().mean().item(), 0.5, 0.015)  # half the mass within one scale
    elif name == "log_normal_":
        assert x.min() > 0
        _close(x.log().mean().item(), 0.5, 0.005)
        _close(x.log().std().item(), 0.25, 0.005)
    elif name == "geometric_":
        assert x.min() >= 1 and torch.equal(x, x.round())
        _close(x.mean().item(), 5.0, 0.15)
    else:
        raise AssertionError(f"no distribution check for {name}")


@pytest.mark.parametrize("name", sorted(OPS))
def test_operator_follows_its_distribution(name):
    torch.supa.manual_seed(17)
    x = OPS[name](N, "supa", None)
    assert x.device.type == "supa"
    _check_distribution(name, x)


@pytest.mark.parametrize("name", sorted(OPS))
def test_operator_is_deterministic_per_seed_and_advances_the_offset(name):
    torch.supa.manual_seed(5)
    first = OPS[name](37, "supa", None).cpu()
    assert _state() == (5, 40)
    torch.supa.manual_seed(5)
    assert torch.equal(OPS[name](37, "supa", None).cpu(), first)
    assert not torch.equal(OPS[name](37, "supa", None).cpu(), first)


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_call_at_a_later_offset_continues_the_same_numbers(name):
    # What DTensor relies on: a shard that starts at element s (a multiple of 4) and at offset base + s
    # draws exactly the unsharded call's elements from s on.
    gen = torch.Generator(device="supa")
    gen.manual_seed(8)
    gen.set_offset(16)
    whole = OPS[name](64, "supa", gen).cpu()
    gen.set_offset(16 + 24)
    tail = OPS[name](64 - 24, "supa", gen).cpu()
    if name.startswith("normal_tensor") or name == "bernoulli_tensor":
        # the tensor arguments of the shard are the shard of the arguments, not a fresh linspace
        return
    assert torch.equal(tail, whole[24:])


@pytest.mark.parametrize("name", ["normal_tensor_mean", "normal_tensor_std", "bernoulli_tensor"])
def test_tensor_argument_operators_continue_the_same_numbers_on_a_shard(name):
    make = {"normal_tensor_mean": lambda m, g: torch.normal(m, 0.5, generator=g),
            "normal_tensor_std": lambda s, g: torch.normal(2.0, s, generator=g),
            "bernoulli_tensor": lambda p, g: torch.bernoulli(p, generator=g)}[name]
    argument = torch.rand(64, device="supa")
    gen = torch.Generator(device="supa")
    gen.manual_seed(8)
    whole = make(argument, gen).cpu()
    gen.set_offset(24)
    assert torch.equal(make(argument[24:], gen).cpu(), whole[24:])


@pytest.mark.parametrize("name", sorted(OPS))
def test_supa_random_ops_leave_the_cpu_generator_alone(name):
    torch.manual_seed(2)
    cpu_state = torch.get_rng_state()
    OPS[name](9, "supa", None)
    assert torch.equal(torch.get_rng_state(), cpu_state)


@multi_device
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_device_draws_the_same_numbers_for_a_seed(name):
    torch.supa.manual_seed_all(6)
    on_0 = OPS[name](33, "supa:0", None).cpu()
    on_1 = OPS[name](33, "supa:1", None).cpu()
    assert torch.equal(on_0, on_1)
    assert _state(0) == _state(1) == (6, 36)


def test_random_numbers_differ_from_the_cpu_generators_as_on_a_card():
    torch.manual_seed(3)
    on_card = torch.rand(64, device="supa").cpu()
    torch.manual_seed(3)
    assert not torch.allclose(on_card, torch.rand(64))


def test_random_bounds_errors_read_as_cpu_and_cuda():
    x = torch.empty(4, device="supa")
    with pytest.raises(RuntimeError, match="random_ expects 'from' to be less than 'to', but got from=3 >= to=3"):
        x.random_(3, 3)
    with pytest.raises(RuntimeError, match="uniform_ expects to return a \\[from, to\\) range, but found from=2 > to=1"):
        x.uniform_(2, 1)
    with pytest.raises(RuntimeError, match="normal expects std >= 0.0"):
        x.normal_(0, -1)
    with pytest.raises(RuntimeError, match="bernoulli_ expects p to be in \\[0, 1\\]"):
        x.bernoulli_(1.5)
    with pytest.raises(RuntimeError, match="geometric_ expects p to be in \\(0, 1\\)"):
        x.geometric_(0)
    with pytest.raises(RuntimeError, match="exponential_ expects lambda > 0.0"):
        x.exponential_(0)


def test_random_full_range_and_complex_normal():
    torch.supa.manual_seed(1)
    full = torch.empty(4096, dtype=torch.int64, device="supa").random_(-(2**63), None).cpu()
    assert full.min() < -(2**61) and full.max() > 2**61
    z = torch.randn(N, dtype=torch.complex64, device="supa").cpu()
    _close(z.real.var().item(), 0.5, 0.02)
    _close(z.imag.var().item(), 0.5, 0.02)


def test_multinomial_with_and_without_replacement():
    torch.supa.manual_seed(12)
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [1.0, 1.0, 1.0, 1.0]], device="supa")
    drawn = torch.multinomial(probs, N // 4, replacement=True).cpu()
    assert drawn.shape == (2, N // 4) and drawn.dtype == torch.int64
    frequencies = torch.stack([torch.bincount(row, minlength=4) for row in drawn]).double() / (N // 4)
    torch.testing.assert_close(frequencies, torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.25] * 4], dtype=torch.float64),
                               rtol=0, atol=0.015)
    without = torch.multinomial(probs, 3).cpu()
    assert all(len(set(row.tolist())) == 3 for row in without)
    assert 1 not in without[0].tolist()  # a category of probability 0 only when nothing else is left
    assert sorted(torch.multinomial(probs[0], 4).cpu().tolist()) == [0, 1, 2, 3]
    first = [torch.multinomial(probs[0], 1).item() for _ in range(2000)]
    _close(first.count(2) / 2000, 0.6, 0.07)
    with pytest.raises(RuntimeError, match="cannot sample n_sample > prob_dist.size\\(-1\\) samples without replacement"):
        torch.multinomial(probs, 5)
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        torch.multinomial(torch.tensor([0.5, -0.1], device="supa"), 1)


def test_multinomial_and_randperm_draw_from_the_device_generator():
    probs = torch.ones(10, device="supa")
    torch.supa.manual_seed(4)
    a = (torch.multinomial(probs, 5).cpu(), torch.randperm(50, device="supa").cpu())
    assert _state()[1] == 12 + 52
    torch.supa.manual_seed(4)
    b = (torch.multinomial(probs, 5).cpu(), torch.randperm(50, device="supa").cpu())
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_randperm_is_a_permutation_in_every_dtype():
    torch.supa.manual_seed(0)
    for dtype in (torch.int64, torch.int32, torch.float32, torch.float16):
        perm = torch.randperm(1000, device="supa", dtype=dtype).cpu()
        assert perm.dtype == dtype
        assert torch.equal(perm.sort().values.long(), torch.arange(1000))
    assert not torch.equal(torch.randperm(1000, device="supa").cpu(), torch.arange(1000))
    with pytest.raises(RuntimeError) as on_cpu:
        torch.randperm(-1)
    with pytest.raises(RuntimeError, match=str(on_cpu.value).replace("[", "\\[").replace("]", "\\]")):
        torch.randperm(-1, device="supa")


def test_dropout_keeps_and_scales_from_the_device_generator():
    x = torch.arange(1, N + 1, dtype=torch.float32, device="supa")
    torch.supa.manual_seed(10)
    out, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    assert _state()[1] == N and mask.dtype == torch.bool
    kept = mask.cpu()
    _close(kept.double().mean().item(), 0.75, 0.01)
    torch.testing.assert_close(out.cpu(), torch.where(kept, x.cpu() / 0.75, 0.0))
    torch.supa.manual_seed(10)
    assert torch.equal(torch.nn.functional.dropout(x, 0.25).cpu(), out.cpu())
    eval_out, eval_mask = torch.ops.aten.native_dropout(x, 0.25, False)
    assert torch.equal(eval_out.cpu(), x.cpu()) and bool(eval_mask.all())


def test_fused_dropout_takes_the_probability_to_keep():
    x = torch.ones(N, device="supa")
    out, mask = torch.ops.aten._fused_dropout(x, 0.8)
    assert mask.dtype == torch.uint8
    _close(mask.double().mean().item(), 0.8, 0.01)
    torch.testing.assert_close(out.cpu(), mask.cpu().float() / 0.8)


def test_attention_and_recurrent_dropout_follow_the_seed():
    q = torch.randn(2, 2, 8, 16, device="supa")
    lstm = torch.nn.LSTM(4, 4, num_layers=2, dropout=0.5).to("supa")
    x = torch.randn(5, 2, 4, device="supa")

    def run():
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        return attention.cpu(), lstm(x)[0].cpu(), _state()[1]

    torch.supa.manual_seed(14)
    first = run()
    torch.supa.manual_seed(14)
    again = run()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert first[2] == 2 * 2 * 8 * 8 + 5 * 2 * 4  # the attention weights, then one layer's outputs
    assert not torch.equal(first[0], torch.nn.functional.scaled_dot_product_attention(q, q, q).cpu())


@pytest.mark.parametrize("op", ["poisson", "binomial", "_standard_gamma", "rrelu_with_noise"])
def test_random_ops_without_a_card_kernel_follow_seed_and_offset(op):
    rates = torch.full((50,), 3.0, device="supa")
    calls = {
        "poisson": lambda: torch.poisson(rates),
        "binomial": lambda: torch.binomial(rates, torch.full_like(rates, 0.5)),
        "_standard_gamma": lambda: torch._standard_gamma(rates),
        "rrelu_with_noise": lambda: torch.ops.aten.rrelu_with_noise(-rates, torch.empty_like(rates), 0.1, 0.3, True),
    }
    torch.supa.manual_seed(3)
    first = calls[op]().cpu()
    assert _state()[1] >= 52
    torch.supa.manual_seed(3)
    assert torch.equal(calls[op]().cpu(), first)
    assert not torch.equal(calls[op]().cpu(), first)
