"""torch.supa RNG: per-device generators, seeding, state save/restore (the Philox state and the random
operators: test_random_operators.py).

The generator is counter-based Philox4x32-10 with CUDA's state (seed, offset). Element i of a random
call at offset o reads Philox counter group o/4 + i/4, lane i % 4, and the call advances the offset by
its element count rounded up to 4: that is what makes a sharded DTensor init equal the unsharded
one (checked in real ranks at the end).
"""

import pytest
from harness import PRISTINE, fresh_process
from ranks import distributed_test
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

multi_device = pytest.mark.skipif(torch.supa.device_count() < 2, reason="needs two SUPA devices")

@pytest.fixture(autouse=True)
def initialised():
    torch.supa.init()

def test_manual_seed_reproduces():
    torch.supa.manual_seed(42)
    a = torch.randn(16, device="supa")
    torch.supa.manual_seed(42)
    b = torch.randn(16, device="supa")
    assert torch.equal(a.cpu(), b.cpu())
    assert torch.supa.initial_seed() == 42

def test_torch_manual_seed_seeds_supa():
    torch.manual_seed(7)
    a = torch.rand(16, device="supa")
    torch.manual_seed(7)
    b = torch.rand(16, device="supa")
    assert torch.equal(a.cpu(), b.cpu())
    assert torch.supa.initial_seed() == 7

def test_different_seeds_differ():
    torch.supa.manual_seed(1)
    a = torch.rand(64, device="supa")
    torch.supa.manual_seed(2)
    b = torch.rand(64, device="supa")
    assert not torch.equal(a.cpu(), b.cpu())

def test_rng_state_round_trip():
    torch.supa.manual_seed(123)
    state = torch.supa.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.randn(8, device="supa")
    torch.supa.set_rng_state(state)
    b = torch.randn(8, device="supa")
    assert torch.equal(a.cpu(), b.cpu())

def test_rng_state_all_round_trip():
    states = torch.supa.get_rng_state_all()
    assert len(states) == torch.supa.device_count()
    a = torch.rand(4, device="supa")
    torch.supa.set_rng_state_all(states)
    b = torch.rand(4, device="supa")
    assert torch.equal(a.cpu(), b.cpu())

def test_get_rng_state_accepts_device_forms():
    idx = torch.supa.current_device()
    ref = torch.supa.get_rng_state()
    assert torch.equal(torch.supa.get_rng_state(idx), ref)
    assert torch.equal(torch.supa.get_rng_state(f"supa:{idx}"), ref)
    assert torch.equal(torch.supa.get_rng_state(torch.device("supa", idx)), ref)

def test_generators_are_device_generators():
    gen = torch.supa.default_generators[0]
    assert gen.device == torch.device("supa:0")
    gen.manual_seed(5)
    a = torch.rand(4, device="supa:0", generator=gen)
    gen.manual_seed(5)
    b = torch.rand(4, device="supa:0", generator=gen)
    assert torch.equal(a.cpu(), b.cpu())

def test_seed_and_seed_all_change_initial_seed():
    torch.supa.manual_seed_all(0)
    torch.supa.seed()
    first = torch.supa.initial_seed()
    torch.supa.seed_all()
    assert torch.supa.initial_seed() != first or first != 0
    seeds = {g.initial_seed() for g in torch.supa.default_generators}
    assert len(seeds) == 1  # seed_all gives every device the same fresh seed

@multi_device
def test_manual_seed_all_seeds_every_device():
    torch.supa.manual_seed_all(99)
    assert all(g.initial_seed() == 99 for g in torch.supa.default_generators)
    with torch.supa.device(1):
        torch.supa.manual_seed(3)
        assert torch.supa.initial_seed() == 3
    assert torch.supa.default_generators[0].initial_seed() == 99

def test_fork_rng_restores_supa_state():
    torch.supa.manual_seed(11)
    expected = torch.rand(4, device="supa")
    torch.supa.manual_seed(11)
    with torch.random.fork_rng(device_type="supa"):
        torch.rand(100, device="supa")
    assert torch.equal(torch.rand(4, device="supa").cpu(), expected.cpu())

def _seeded_before_init() -> None:
    torch.manual_seed(77)
    assert not torch.supa.is_initialized()
    a = torch.rand(3, device="supa")
    torch.supa.manual_seed(77)
    b = torch.rand(3, device="supa")
    assert torch.equal(a.cpu(), b.cpu())
    assert torch.supa.initial_seed() == 77

_SEEDED_BEFORE_INIT = fresh_process(_seeded_before_init, shared=PRISTINE)

def test_seeding_before_init_is_deferred():
    _SEEDED_BEFORE_INIT.result()

# ------------------------------------------------------------------------------------------------
# DTensor: a sharded random init equals the unsharded one (real ranks)
# ------------------------------------------------------------------------------------------------
def _sharded_init_equals_unsharded(mesh_shape: tuple, placements: list, shape: tuple) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("supa", mesh_shape)
    torch.manual_seed(1234)
    normal = torch.empty(shape, device="supa").normal_()
    uniform = torch.empty(shape, device="supa").uniform_()
    state = torch.supa.get_rng_state()
    torch.manual_seed(1234)
    sharded_normal = distribute_tensor(torch.empty(shape, device="supa"), mesh, placements).normal_()
    sharded_uniform = distribute_tensor(torch.empty(shape, device="supa"), mesh, placements).uniform_()
    assert torch.equal(sharded_normal.full_tensor().cpu(), normal.cpu()), "normal_"
    assert torch.equal(sharded_uniform.full_tensor().cpu(), uniform.cpu()), "the next call"
    assert torch.equal(torch.supa.get_rng_state(), state), "the generator's state after"

_SHAPES = [(8, 8), (5, 8)]  # (5, 8): shards of 3 and 2 rows

@pytest.mark.slow
@pytest.mark.parametrize("shape", _SHAPES)
@distributed_test(world=2)
def test_sharded_dtensor_init_equals_the_unsharded_init_on_a_1d_mesh(rank, world, shape):
    from torch.distributed.tensor import Shard
    _sharded_init_equals_unsharded((2,), [Shard(0)], shape)

@pytest.mark.slow
@pytest.mark.skipif(torch.supa.device_count() < 4, reason="needs 4 SUPA devices")
@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("sharded_dim", [0, 1], ids=["dp_sharded", "tp_sharded"])
@distributed_test(world=4)
def test_sharded_dtensor_init_equals_the_unsharded_init_on_a_2d_mesh(rank, world, sharded_dim, shape):
    from torch.distributed.tensor import Replicate, Shard

    placements = [Replicate(), Replicate()]
    placements[sharded_dim] = Shard(0)
    _sharded_init_equals_unsharded((2, 2), placements, shape)
