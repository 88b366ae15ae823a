"""bccl as torch.distributed's c10d layer and DeviceMesh use an accelerator backend (NCCL's role).

Each test body runs in every rank (harness.distributed_test: SUPA_EMULATE=1, rank r on supa:r, CUDA
names transferred to supa) and initialises the default group it is about itself; what the ranks
compute is checked against plain arithmetic on the ranks' numbers.

Covered: init_process_group(device_id=...) with "bccl"/supa and with "nccl"/cuda names (eager
init, bound device), the backend object `_get_backend(device)` returns and the attributes c10d
reads of it, split_group, new_group with and without use_local_synchronization, nocolor splits
and split counts, sequence numbers, coalescing on subgroups, group.size()/rank() on subgroups,
ProcessGroup.Options, abort/shutdown (later use raises DistBackendError, as NCCL's aborted
communicators do), DeviceMesh 1-D and 2-D (named dims, get_group, slicing, flattening), FSDP2
(fully_shard) and DeepSpeed ZeRO-3 on a device_id-bound group, and the
bad input of the issue: device_id on another device type or beyond the visible cards, splits with
overlapping subgroups or ranks the parent does not have (a ValueError on every rank, no hang).
"""

import datetime
import time
import warnings

import pytest
from ranks import distributed_test, rank_store
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

pytestmark = [
    pytest.mark.slow,  # multi-process jobs
    pytest.mark.skipif(not (hasattr(torch, "supa") and torch.supa.is_available() and torch.supa.device_count() >= 4),
                       reason="needs 4 SUPA cards (real, or emulated with SUPA_EMULATE=1)"),
]


def _init(rank: int, world: int, backend: str = "bccl", device_id=None, prefix: str = "group"):
    """Initialises the default group from the body's store (a prefix of it per initialisation)."""
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, rank_store()), rank=rank, world_size=world,
                            device_id=device_id)


def _bound(rank: int, world: int):
    """A bccl default group bound to this rank's card (device_id); returns its backend object."""
    _init(rank, world, device_id=torch.device("supa", rank))
    return dist.group.WORLD._get_backend(torch.device("supa"))


def _sum_of_ranks(group=None) -> float:
    t = torch.full((3,), float(dist.get_rank()), device="supa")
    dist.all_reduce(t, group=group)
    return t[0].item()


# ------------------------------------------------------------------------------------------------
# init_process_group(device_id=...) and the backend object
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend, device, fragment", [
    ("bccl", "supa:64", "out of range"),  # beyond the visible cards
    ("bccl", "meta:0", "does not match"),  # another device type
    ("bccl", "supa", "index"),  # no index
    ("nccl", "cuda:64", "out of range"),  # code written for CUDA
])
@distributed_test(backend=None)
def test_a_bad_device_id_is_refused_before_any_rank_talks(rank, world, backend, device, fragment):
    with pytest.raises(ValueError, match=fragment):
        _init(rank, world, backend, torch.device(device))
    assert not dist.is_initialized()


@distributed_test(backend=None)
def test_device_id_binds_the_default_group_to_the_card(rank, world):
    _bound(rank, world)
    assert dist.group.WORLD.bound_device_id == torch.device("supa", rank)
    assert c10d._is_safe_to_split()
    assert _sum_of_ranks() == 1.0  # an all_reduce after the eager init


@distributed_test(backend=None)
def test_the_backend_object_says_what_c10d_reads_of_it(rank, world):
    backend = _bound(rank, world)
    assert backend.supports_splitting and backend.supports_coalescing
    assert not (backend.supports_time_estimate or backend.supports_shrinking
                or backend.supports_tensor_alloc(torch.device("supa", rank)))
    assert backend.name() == "bccl"
    assert isinstance(backend.options, dist.ProcessGroupNCCL.Options)
    assert backend.options._timeout == datetime.timedelta(minutes=10)
    assert dist.group.WORLD._get_backend(torch.device("cuda")) is backend  # under the transfer, CUDA names reach it


@pytest.mark.parametrize("device, fragment", [("cpu", "supa"), ("supa:64", "out of range")])
@distributed_test(backend=None)
def test_eager_connect_refuses_another_device(rank, world, device, fragment):
    backend = _bound(rank, world)
    with pytest.raises(ValueError, match=fragment):
        backend.eager_connect_single_device(torch.device(device))


@distributed_test(backend=None)
def test_cuda_named_code_binds_nccl_to_the_card(rank, world):
    torch.cuda.set_device(rank)
    _init(rank, world, "nccl", torch.device("cuda", rank))
    assert dist.get_backend() == "bccl"
    assert dist.group.WORLD.bound_device_id == torch.device("supa", rank)


# ------------------------------------------------------------------------------------------------
# Subgroups of a bound group: new_group, split_group
# ------------------------------------------------------------------------------------------------
@distributed_test(backend=None)
def test_new_group_splits_for_members_and_nocolor_splits_for_the_others(rank, world):
    backend = _bound(rank, world)
    both = dist.new_group([0, 1])
    only0 = dist.new_group([0])
    assert (both.size(), both.rank()) == (2, rank) and _sum_of_ranks(both) == 1.0
    if rank == 0:
        assert (only0.size(), only0.rank()) == (1, 0)
    else:
        assert only0 is dist.GroupMember.NON_GROUP_MEMBER, only0
    assert backend.comm_split_count() == 2


@distributed_test(backend=None)
def test_split_group_into_single_ranks(rank, world):
    _bound(rank, world)
    singles = dist.split_group(split_ranks=[[0], [1]], group_desc="singles")
    assert (singles.size(), singles.rank()) == (1, 0)
    assert singles.bound_device_id == torch.device("supa", rank)
    assert dist.get_process_group_ranks(singles) == [rank] and singles.group_desc == "singles"
    assert _sum_of_ranks(singles) == float(rank)


@distributed_test(backend=None)
def test_split_group_counts_its_splits(rank, world):
    backend = _bound(rank, world)
    dist.split_group(split_ranks=[[0], [1]])
    pair = dist.split_group(split_ranks=[[1, 0]])
    assert (pair.size(), pair.rank()) == (2, rank) and _sum_of_ranks(pair) == 1.0
    assert pair.group_desc.endswith(":split:1"), pair.group_desc  # the default group's 2nd split
    left_out = dist.split_group(split_ranks=[[0]])
    if rank == 1:
        assert left_out is None
    else:
        assert left_out.size() == 1
    assert backend.comm_split_count() == 3


@distributed_test(backend=None)
def test_split_group_of_a_subgroup(rank, world):
    _bound(rank, world)
    pair = dist.split_group(split_ranks=[[1, 0]])
    assert dist.split_group(parent_pg=pair, split_ranks=[[0, 1]]).size() == 2
    assert pair.comm_split_count() == 1


@pytest.mark.parametrize("split_ranks, fragment", [
    ([[0], [0, 1]], "must not overlap"),
    ([[0, 2]], "does not have"),
    ([[0, 0]], "duplicate"),
])
@distributed_test(backend=None)
def test_a_bad_split_raises_on_every_rank_and_the_group_stays_usable(rank, world, split_ranks, fragment):
    _bound(rank, world)
    with pytest.raises(ValueError, match=fragment):
        dist.split_group(split_ranks=split_ranks)
    assert _sum_of_ranks() == 1.0


@distributed_test(backend=None)
def test_sequence_numbers_count_collectives_not_point_to_point(rank, world):
    _bound(rank, world)
    pair = dist.split_group(split_ranks=[[0, 1]])
    pair._set_sequence_number_for_group()
    start = pair._get_sequence_number_for_group()
    t = torch.ones(2, device="supa")
    dist.all_reduce(t, group=pair)
    dist.broadcast(t, group_src=0, group=pair)
    if rank == 0:
        dist.send(t, group_dst=1, group=pair)
    else:
        dist.recv(t, group_src=0, group=pair)
    with dist._coalescing_manager(group=pair, device="supa", async_ops=True) as cm:  # one, for the block
        dist.all_reduce(t, group=pair)
        dist.all_reduce(t.clone(), group=pair)
    cm.wait()
    everyone = [None, None]
    dist.all_gather_object(everyone, pair._get_sequence_number_for_group() - start)
    assert everyone == [3, 3]


@distributed_test(backend=None)
def test_coalescing_on_a_subgroup(rank, world):
    _bound(rank, world)
    pair = dist.split_group(split_ranks=[[0, 1]])
    a, b = torch.full((4,), rank + 1.0, device="supa"), torch.full((2,), rank + 10.0, device="supa")
    with dist._coalescing_manager(group=pair, device="supa", async_ops=True) as cm:
        dist.all_reduce(a, group=pair)
        dist.all_reduce(b, group=pair)
    cm.wait()
    assert a.tolist() == [3.0] * 4 and b.tolist() == [21.0] * 2, (a, b)


@distributed_test(backend=None)
def test_a_high_priority_stream_option_warns_that_it_is_not_modelled(rank, world):
    _bound(rank, world)
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group = dist.new_group([0, 1], pg_options=options)
    assert any("is_high_priority_stream" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert group.options.is_high_priority_stream and _sum_of_ranks(group) == 1.0


# ------------------------------------------------------------------------------------------------
# Teardown: an aborted or shut-down group raises DistBackendError, as NCCL's does, and the default
# group stays usable
# ------------------------------------------------------------------------------------------------
@distributed_test(backend=None)
def test_an_aborted_group_refuses_later_calls(rank, world):
    _bound(rank, world)
    group = dist.new_group([0, 1])
    _sum_of_ranks(group)
    group.abort()
    with pytest.raises(dist.DistBackendError, match="aborted"):
        dist.all_reduce(torch.ones(1, device="supa"), group=group)
    with pytest.raises(dist.DistBackendError, match="aborted"):
        dist.split_group(parent_pg=group, split_ranks=[[0, 1]])
    assert _sum_of_ranks() == 1.0


@distributed_test(backend=None)
def test_abort_fails_the_pending_work(rank, world):
    _bound(rank, world)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
    _sum_of_ranks(group)
    if rank == 1:
        time.sleep(0.5)  # never joins the collective rank 0 started; aborts instead
        group.abort()
    else:
        pending = dist.all_reduce(torch.ones(1 << 16, device="supa"), group=group, async_op=True)
        group.abort()
        # The abort's own error, at once: not gloo's, after the group's timeout.
        with pytest.raises(dist.DistBackendError, match="was aborted on rank 0"):
            pending.wait()
        assert pending.is_completed() and not pending.is_success()
    assert _sum_of_ranks() == 1.0


@distributed_test(backend=None)
def test_a_shut_down_group_refuses_later_calls(rank, world):
    _bound(rank, world)
    group = dist.new_group([0, 1])
    dist.destroy_process_group(group)  # calls shutdown()
    with pytest.raises(dist.DistBackendError, match="shut down"):
        group.allreduce([torch.ones(1, device="supa")])
    assert _sum_of_ranks() == 1.0


@distributed_test(backend=None)
def test_a_peer_that_aborted_fails_the_call_instead_of_hanging(rank, world):
    _bound(rank, world)
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=4))  # what rank 0 waits at most
    _sum_of_ranks(group)
    dist.barrier()
    if rank == 1:
        group.abort()
    else:
        with pytest.raises(dist.DistBackendError):
            dist.all_reduce(torch.ones(1, device="supa"), group=group)
    assert _sum_of_ranks() == 1.0


@distributed_test(backend=None)
def test_wait_with_a_timeout_bounds_the_call_not_the_groups_timeout(rank, world):
    _bound(rank, world)
    store = rank_store()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=90))
    _sum_of_ranks(group)
    if rank == 0:  # a peer that never joins
        store.wait(["rank 1 done"])
        group.abort()
    else:
        pending = group.allreduce([torch.ones(1, device="supa")])
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError, match=r"caught collective operation timeout.*0:00:00\.2"):
            pending.wait(datetime.timedelta(seconds=0.2))
        elapsed = time.monotonic() - start
        store.set("rank 1 done", "1")
        group.abort()
        assert elapsed < 45, f"wait(0.2 s) returned after {elapsed:.1f} s: the group's 90 s timeout applied"
    assert _sum_of_ranks() == 1.0


# ------------------------------------------------------------------------------------------------
# Code written for CUDA on a bound "nccl" group: DeviceMesh, FSDP2, DeepSpeed ZeRO-3
# ------------------------------------------------------------------------------------------------
def _bound_nccl(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    _init(rank, world, "nccl", torch.device("cuda", rank))


def _mlp_and_its_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference.load_state_dict(model.state_dict())
    return model, reference


def _reference_step(reference, optimizer, data) -> None:
    """A step of the model on the whole batch in this process, on the CPU: what both ranks' halves make."""
    (reference(data[:2]).pow(2).mean() / 2 + reference(data[2:]).pow(2).mean() / 2).backward()
    optimizer.step()
    optimizer.zero_grad()


@distributed_test(backend=None)
def test_device_mesh_1d_on_cuda_names(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    _bound_nccl(rank, world)
    mesh = init_device_mesh("cuda", (2,))
    group = mesh.get_group()
    assert mesh.device_type == "supa" and group.size() == 2 and _sum_of_ranks(group) == 1.0, mesh


@distributed_test(backend=None)
def test_new_group_with_local_synchronization(rank, world):
    _bound_nccl(rank, world)
    group = dist.new_group([0, 1], use_local_synchronization=True)
    assert group.size() == 2 and group.rank() == rank and _sum_of_ranks(group) == 1.0, group


@distributed_test(backend=None)
def test_fsdp2_on_the_mesh_trains_as_one_process(rank, world):
    # The recipe torch's warning points at: device_id, a DeviceMesh, fully_shard.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _bound_nccl(rank, world)
    model, reference = _mlp_and_its_reference()
    mesh = init_device_mesh("cuda", (2,))
    model.cuda()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(data[2 * rank:2 * rank + 2].cuda()).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        _reference_step(reference, reference_optimizer, data)
    trained = {name: value.full_tensor().cpu() for name, value in model.state_dict().items()}
    for name, value in reference.state_dict().items():
        assert torch.allclose(trained[name], value, atol=1e-6), name


@distributed_test(backend=None)
def test_deepspeed_zero3_on_the_bound_group_trains_as_one_process(rank, world):
    # Every group ZeRO-3 makes is split from the bound default group.
    import os

    _bound_nccl(rank, world)
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    model, reference = _mlp_and_its_reference()
    initial = [p.detach().clone() for p in reference.parameters()]
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1000}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        engine.backward(engine(data[2 * rank:2 * rank + 2].cuda()).pow(2).mean())
        engine.step()
        _reference_step(reference, reference_optimizer, data)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = [p.detach().cpu().clone() for p in engine.module.parameters()]
    for got, want, start in zip(trained, reference.parameters(), initial):
        assert torch.allclose(got, want.detach(), atol=1e-6) and not torch.equal(got, start), (got, want)


# ------------------------------------------------------------------------------------------------
# Four ranks: a (dp=2, tp=2) DeviceMesh on a bound default group (split_group path) and on an
# unbound one (new_group path); the mesh is arange(4).view(2, 2): rows are dp, columns tp
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "unbound"])
@distributed_test(world=4, backend=None)
def test_device_mesh_2d(rank, world, bound):
    from torch.distributed.device_mesh import init_device_mesh

    dev = torch.device("supa", rank)
    _init(rank, world, device_id=dev if bound else None)
    dp, tp = divmod(rank, 2)
    tp_ranks, dp_ranks = [2 * dp, 2 * dp + 1], [tp, tp + 2]
    mesh = init_device_mesh("supa", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    assert dist.get_process_group_ranks(tp_group) == tp_ranks
    assert dist.get_process_group_ranks(dp_group) == dp_ranks
    assert (tp_group.size(), tp_group.rank(), dp_group.size(), dp_group.rank()) == (2, tp, 2, dp)
    assert _sum_of_ranks(tp_group) == sum(tp_ranks), "tp sum"
    assert _sum_of_ranks(dp_group) == sum(dp_ranks), "dp sum"
    tp_mesh = mesh["tp"]
    assert tp_mesh.mesh.tolist() == tp_ranks and tp_mesh.get_local_rank() == tp, tp_mesh
    assert dist.get_process_group_ranks(tp_mesh.get_group()) == tp_ranks, "sliced group"
    flat = mesh["dp", "tp"]._flatten("dp_tp")
    assert flat.get_group().size() == 4 and _sum_of_ranks(flat.get_group()) == 6.0, flat
    if bound:  # DeviceMesh split the bound group: its subgroups are bound to the card too
        assert tp_group.bound_device_id == dev and dp_group.bound_device_id == dev, tp_group.bound_device_id


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "unbound"])
@distributed_test(world=4, backend=None)
def test_new_group_with_local_synchronization_of_pairs(rank, world, bound):
    # Only the members call new_group: each pair makes its own group without the others.
    _init(rank, world, device_id=torch.device("supa", rank) if bound else None)
    dp, tp = divmod(rank, 2)
    tp_ranks = [2 * dp, 2 * dp + 1]
    group = dist.new_group(tp_ranks, use_local_synchronization=True)
    assert group.size() == 2 and group.rank() == tp and _sum_of_ranks(group) == sum(tp_ranks), group
