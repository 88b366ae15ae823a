"""bccl as torch.distributed's c10d layer and DeviceMesh use an accelerator backend (NCCL's role).

Each job starts real ranks (SUPA_EMULATE=1, rank r on supa:r, CUDA names transferred to supa) that
run one scenario from this file and report named outcomes, which the tests below read. What the
ranks compute is checked against plain arithmetic on the ranks' numbers.

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
from harness import RankChecks, run_ranks, serve_rank
import torch

pytestmark = [
    pytest.mark.slow,  # multi-process jobs
    pytest.mark.skipif(not (hasattr(torch, "supa") and torch.supa.is_available() and torch.supa.device_count() >= 4),
                       reason="needs 4 SUPA cards (real, or emulated with SUPA_EMULATE=1)"),
]


# ------------------------------------------------------------------------------------------------
# Worker side (runs in the spawned ranks)
# ------------------------------------------------------------------------------------------------
def _expect(condition, detail):
    if not condition:
        raise AssertionError(str(detail))


def _raises(kind, fn, *fragments):
    try:
        fn()
    except kind as error:
        for fragment in fragments:
            _expect(fragment in str(error), f"{fragment!r} not in {error}")
        return
    except Exception as error:
        raise AssertionError(f"expected {kind.__name__}, got {type(error).__name__}: {error}")
    raise AssertionError(f"expected {kind.__name__}, nothing raised")


def _start(rank: int, port: int, world: int):
    """A rank's checks, its card and the job's store (each init_process_group takes a prefix of it)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    return RankChecks(), torch.device("supa", rank), store


def _init(store, prefix: str, rank: int, world: int, backend: str, device_id=None):
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            device_id=device_id)


def _sum_of_ranks(group, dev) -> float:
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(dist.get_rank()), device=dev)
    dist.all_reduce(t, group=group)
    return t[0].item()


def _scenario_bound(rank: int, port: int) -> dict:
    """2 ranks: device_id binding, the backend object, splits, sequence numbers, teardown."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = 2
    check, dev, store = _start(rank, port, world)

    # Bad device_id values are refused before any rank talks to another: nothing to hang on.
    check("device_id/beyond_visible_cards", lambda: _raises(
        ValueError, lambda: _init(store, "bad1", rank, world, "bccl", torch.device("supa", 64)), "out of range"))
    check("device_id/other_device_type", lambda: _raises(
        ValueError, lambda: _init(store, "bad2", rank, world, "bccl", torch.device("meta", 0)), "does not match"))
    check("device_id/no_index", lambda: _raises(
        ValueError, lambda: _init(store, "bad3", rank, world, "bccl", torch.device("supa")), "index"))

    torch.accelerator.set_device_index(rank)
    _init(store, "bccl", rank, world, "bccl", dev)
    world_pg = dist.group.WORLD
    backend = world_pg._get_backend(torch.device("supa"))

    check("bound_device", lambda: _expect(world_pg.bound_device_id == dev and c10d._is_safe_to_split(),
                                          world_pg.bound_device_id))
    check("backend_object", lambda: _expect(
        backend.supports_splitting and backend.supports_coalescing and not backend.supports_time_estimate
        and not backend.supports_shrinking and not backend.supports_tensor_alloc(dev)
        and backend.name() == "bccl" and isinstance(backend.options, dist.ProcessGroupNCCL.Options)
        and backend.options._timeout == datetime.timedelta(minutes=10)
        # under the transfer, CUDA names reach the same backend
        and world_pg._get_backend(torch.device("cuda")) is backend, backend))
    check("all_reduce_after_eager_init", lambda: _expect(_sum_of_ranks(None, dev) == 1.0, "sum"))
    check("eager_connect/other_device_type", lambda: _raises(
        ValueError, lambda: backend.eager_connect_single_device(torch.device("cpu")), "supa"))
    check("eager_connect/beyond_visible_cards", lambda: _raises(
        ValueError, lambda: backend.eager_connect_single_device(torch.device("supa", 64)), "out of range"))

    # new_group on a bound default group: members split, the others take part with a nocolor split.
    both = dist.new_group([0, 1])
    only0 = dist.new_group([0])
    check("new_group/members", lambda: _expect(
        both.size() == 2 and both.rank() == rank and _sum_of_ranks(both, dev) == 1.0, (both.size(), both.rank())))
    check("new_group/non_member", lambda: _expect(
        (only0.size(), only0.rank()) == (1, 0) if rank == 0 else only0 is dist.GroupMember.NON_GROUP_MEMBER, only0))
    check("comm_split_count/new_group", lambda: _expect(backend.comm_split_count() == 2, backend.comm_split_count()))

    # split_group: all ranks call it with the whole split.
    singles = dist.split_group(split_ranks=[[0], [1]], group_desc="singles")
    check("split_group/singles", lambda: _expect(
        (singles.size(), singles.rank()) == (1, 0) and singles.bound_device_id == dev
        and dist.get_process_group_ranks(singles) == [rank] and singles.group_desc == "singles"
        and _sum_of_ranks(singles, dev) == float(rank), singles))
    pair = dist.split_group(split_ranks=[[1, 0]])
    check("split_group/pair", lambda: _expect(
        (pair.size(), pair.rank()) == (2, rank) and _sum_of_ranks(pair, dev) == 1.0
        and pair.group_desc.endswith(":split:3"), pair.group_desc))  # default_pg's 4th split
    left_out = dist.split_group(split_ranks=[[0]])
    check("split_group/rank_left_out", lambda: _expect(
        (left_out is None) == (rank == 1) and (rank == 1 or left_out.size() == 1), left_out))
    check("comm_split_count/split_group", lambda: _expect(backend.comm_split_count() == 5, backend.comm_split_count()))
    check("split_group/of_a_subgroup", lambda: _expect(
        dist.split_group(parent_pg=pair, split_ranks=[[0, 1]]).size() == 2 and pair.comm_split_count() == 1,
        pair.comm_split_count()))

    # Bad splits raise the same error on every rank, and the group stays usable.
    check("split_group/overlapping", lambda: _raises(
        ValueError, lambda: dist.split_group(split_ranks=[[0], [0, 1]]), "must not overlap"))
    check("split_group/rank_parent_lacks", lambda: _raises(
        ValueError, lambda: dist.split_group(split_ranks=[[0, 2]]), "does not have"))
    check("split_group/duplicates", lambda: _raises(
        ValueError, lambda: dist.split_group(split_ranks=[[0, 0]]), "duplicate"))
    check("usable_after_bad_splits", lambda: _expect(_sum_of_ranks(None, dev) == 1.0, "sum"))

    # Sequence numbers count collectives (a coalesced block once, point-to-point not at all).
    def sequence_numbers():
        pair._set_sequence_number_for_group()
        start = pair._get_sequence_number_for_group()
        t = torch.ones(2, device=dev)
        dist.all_reduce(t, group=pair)
        dist.broadcast(t, group_src=0, group=pair)
        if rank == 0:
            dist.send(t, group_dst=1, group=pair)
        else:
            dist.recv(t, group_src=0, group=pair)
        with dist._coalescing_manager(group=pair, device=dev, async_ops=True) as cm:
            dist.all_reduce(t, group=pair)
            dist.all_reduce(t.clone(), group=pair)
        cm.wait()
        seen = pair._get_sequence_number_for_group() - start
        everyone = [None, None]
        dist.all_gather_object(everyone, seen)
        _expect(everyone == [3, 3], everyone)

    check("sequence_numbers", sequence_numbers)

    def coalescing_on_subgroup():
        a, b = torch.full((4,), rank + 1.0, device=dev), torch.full((2,), rank + 10.0, device=dev)
        with dist._coalescing_manager(group=pair, device=dev, async_ops=True) as cm:
            dist.all_reduce(a, group=pair)
            dist.all_reduce(b, group=pair)
        cm.wait()
        _expect(a.tolist() == [3.0] * 4 and b.tolist() == [21.0] * 2, (a, b))

    check("coalescing_on_subgroup", coalescing_on_subgroup)

    def high_priority_option():
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            group = dist.new_group([0, 1], pg_options=options)
        _expect(any("is_high_priority_stream" in str(w.message) for w in caught), [str(w.message) for w in caught])
        _expect(group.options.is_high_priority_stream and _sum_of_ranks(group, dev) == 1.0, group.options)

    check("options/high_priority_stream_says_unmodelled", high_priority_option)

    # Teardown: an aborted or shut-down group raises DistBackendError, as NCCL's does.
    def aborted_group():
        group = dist.new_group([0, 1])
        _sum_of_ranks(group, dev)
        group.abort()
        _raises(dist.DistBackendError, lambda: dist.all_reduce(torch.ones(1, device=dev), group=group), "aborted")
        _raises(dist.DistBackendError, lambda: dist.split_group(parent_pg=group, split_ranks=[[0, 1]]), "aborted")

    check("abort", aborted_group)

    def pending_work_of_an_aborted_group():
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
        _sum_of_ranks(group, dev)
        if rank == 1:
            time.sleep(0.5)  # never joins the collective rank 0 started; aborts instead
            group.abort()
            return
        pending = dist.all_reduce(torch.ones(1 << 16, device=dev), group=group, async_op=True)
        group.abort()
        _raises(dist.DistBackendError, pending.wait)

    check("abort/pending_work", pending_work_of_an_aborted_group)

    def shut_down_group():
        group = dist.new_group([0, 1])
        dist.destroy_process_group(group)  # calls shutdown()
        _raises(dist.DistBackendError, lambda: group.allreduce([torch.ones(1, device=dev)]), "shut down")

    check("shutdown", shut_down_group)

    def peer_aborts():
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=20))
        _sum_of_ranks(group, dev)
        dist.barrier()
        if rank == 1:
            group.abort()
            return
        _raises(dist.DistBackendError, lambda: dist.all_reduce(torch.ones(1, device=dev), group=group))

    check("peer_aborted_fails_not_hangs", peer_aborts)

    def wait_timeout_bounds_the_call():
        # A peer that never joins: wait(timeout) gives up after its own timeout, not the group's.
        group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=90))
        _sum_of_ranks(group, dev)
        if rank == 0:
            store.wait(["wait_timeout/done"])
            group.abort()
            return
        pending = group.allreduce([torch.ones(1, device=dev)])
        start = time.monotonic()
        _raises(dist.DistBackendError, lambda: pending.wait(datetime.timedelta(seconds=0.2)),
                "caught collective operation timeout", "0:00:00.2")
        elapsed = time.monotonic() - start
        store.set("wait_timeout/done", "1")
        group.abort()
        _expect(elapsed < 45, f"wait(0.2 s) returned after {elapsed:.1f} s: the group's 90 s timeout applied")

    check("wait_timeout_bounds_the_call", wait_timeout_bounds_the_call)
    check("world_usable_after_teardowns", lambda: _expect(_sum_of_ranks(None, dev) == 1.0, "sum"))
    dist.destroy_process_group()
    return check.outcomes


def _scenario_transfer_nccl(rank: int, port: int) -> dict:
    """2 ranks, code written for CUDA: init_process_group('nccl', device_id=cuda:r), DeviceMesh 1-D."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = 2
    check, dev, store = _start(rank, port, world)
    check("device_id/beyond_visible_cards", lambda: _raises(
        ValueError, lambda: _init(store, "bad", rank, world, "nccl", torch.device("cuda", 64)), "out of range"))
    torch.cuda.set_device(rank)
    _init(store, "nccl", rank, world, "nccl", torch.device("cuda", rank))
    check("bound_to_the_card", lambda: _expect(
        dist.get_backend() == "bccl" and dist.group.WORLD.bound_device_id == dev, dist.group.WORLD.bound_device_id))

    def mesh_1d():
        mesh = init_device_mesh("cuda", (2,))
        group = mesh.get_group()
        _expect(mesh.device_type == "supa" and group.size() == 2 and _sum_of_ranks(group, dev) == 1.0, mesh)

    check("device_mesh_1d", mesh_1d)

    def fsdp2_on_the_mesh():
        # The recipe torch's warning points at: device_id, a DeviceMesh, fully_shard. The reference
        # is the same model trained on the whole batch in this process, on the CPU.
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        reference.load_state_dict(model.state_dict())
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
            (reference(data[:2]).pow(2).mean() / 2 + reference(data[2:]).pow(2).mean() / 2).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        trained = {name: value.full_tensor().cpu() for name, value in model.state_dict().items()}
        for name, value in reference.state_dict().items():
            _expect(torch.allclose(trained[name], value, atol=1e-6), name)

    check("fsdp2_on_the_mesh", fsdp2_on_the_mesh)

    def deepspeed_zero3_on_the_bound_group():
        # Every group ZeRO-3 makes is now split from the bound default group. Reference as above.
        import os

        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
        import deepspeed

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        reference.load_state_dict(model.state_dict())
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
            (reference(data[:2]).pow(2).mean() / 2 + reference(data[2:]).pow(2).mean() / 2).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            trained = [p.detach().cpu().clone() for p in engine.module.parameters()]
        for got, want, start in zip(trained, reference.parameters(), initial):
            _expect(torch.allclose(got, want.detach(), atol=1e-6) and not torch.equal(got, start), (got, want))

    check("deepspeed_zero3_on_the_bound_group", deepspeed_zero3_on_the_bound_group)

    def local_synchronization():
        group = dist.new_group([0, 1], use_local_synchronization=True)
        _expect(group.size() == 2 and group.rank() == rank and _sum_of_ranks(group, dev) == 1.0, group)

    check("new_group/use_local_synchronization", local_synchronization)
    dist.destroy_process_group()
    return check.outcomes


def _scenario_mesh_2d(rank: int, port: int) -> dict:
    """4 ranks: a (dp=2, tp=2) DeviceMesh on a bound default group (split_group path) and on an
    unbound one (new_group path)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = 4
    check, dev, store = _start(rank, port, world)
    torch.accelerator.set_device_index(rank)
    dp, tp = divmod(rank, 2)  # the mesh is arange(4).view(2, 2): rows are dp, columns tp
    tp_ranks, dp_ranks = [2 * dp, 2 * dp + 1], [tp, tp + 2]

    for round_name, device_id in (("bound", dev), ("unbound", None)):
        _init(store, round_name, rank, world, "bccl", device_id)

        def mesh_2d():
            mesh = init_device_mesh("supa", (2, 2), mesh_dim_names=("dp", "tp"))
            tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
            _expect(dist.get_process_group_ranks(tp_group) == tp_ranks, dist.get_process_group_ranks(tp_group))
            _expect(dist.get_process_group_ranks(dp_group) == dp_ranks, dist.get_process_group_ranks(dp_group))
            _expect((tp_group.size(), tp_group.rank(), dp_group.size(), dp_group.rank()) == (2, tp, 2, dp),
                    (tp_group.rank(), dp_group.rank()))
            _expect(_sum_of_ranks(tp_group, dev) == sum(tp_ranks), "tp sum")
            _expect(_sum_of_ranks(dp_group, dev) == sum(dp_ranks), "dp sum")
            tp_mesh = mesh["tp"]
            _expect(tp_mesh.mesh.tolist() == tp_ranks and tp_mesh.get_local_rank() == tp, tp_mesh)
            _expect(dist.get_process_group_ranks(tp_mesh.get_group()) == tp_ranks, "sliced group")
            flat = mesh["dp", "tp"]._flatten("dp_tp")
            flat_group = flat.get_group()
            _expect(flat_group.size() == 4 and _sum_of_ranks(flat_group, dev) == 6.0, flat)
            if device_id is not None:
                # DeviceMesh split the bound group: its subgroups are bound to the card too.
                _expect(tp_group.bound_device_id == dev and dp_group.bound_device_id == dev, tp_group.bound_device_id)

        check(f"{round_name}/device_mesh_2d", mesh_2d)

        def local_synchronization():
            # Only the members call new_group: each pair makes its own group without the others.
            group = dist.new_group(tp_ranks, use_local_synchronization=True)
            _expect(group.size() == 2 and group.rank() == tp and _sum_of_ranks(group, dev) == sum(tp_ranks), group)

        check(f"{round_name}/new_group/use_local_synchronization", local_synchronization)
        dist.destroy_process_group()
    return check.outcomes


# ------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------
def _outcomes(scenario: str, world: int):
    results = run_ranks(__file__, scenario, world=world, limit_s=420)
    outcomes = []
    for rank, (code, outcome, err) in enumerate(results):
        assert code == 0 and outcome is not None, f"rank {rank} failed ({code}):\n{err[-4000:]}"
        outcomes.append(outcome)
    return outcomes


@pytest.fixture(scope="module")
def bound():
    return _outcomes("bound", 2)


@pytest.fixture(scope="module")
def transfer_nccl():
    return _outcomes("transfer_nccl", 2)


@pytest.fixture(scope="module")
def mesh_2d():
    return _outcomes("mesh_2d", 4)


def _assert_ok(outcomes, name):
    for rank, outcome in enumerate(outcomes):
        assert outcome.get(name) == "ok", f"rank {rank}: {name}: {outcome.get(name)}"


_BOUND = [
    "bound_device", "backend_object", "all_reduce_after_eager_init", "new_group/members", "new_group/non_member",
    "comm_split_count/new_group", "split_group/singles", "split_group/pair", "split_group/rank_left_out",
    "comm_split_count/split_group", "split_group/of_a_subgroup", "usable_after_bad_splits", "sequence_numbers",
    "coalescing_on_subgroup", "options/high_priority_stream_says_unmodelled", "abort", "abort/pending_work",
    "shutdown",
    "peer_aborted_fails_not_hangs", "wait_timeout_bounds_the_call", "world_usable_after_teardowns",
]
_BOUND_BAD_INPUT = [
    "device_id/beyond_visible_cards", "device_id/other_device_type", "device_id/no_index",
    "eager_connect/other_device_type", "eager_connect/beyond_visible_cards", "split_group/overlapping",
    "split_group/rank_parent_lacks", "split_group/duplicates",
]


@pytest.mark.parametrize("name", _BOUND)
def test_bound_group(bound, name):
    _assert_ok(bound, name)


@pytest.mark.parametrize("name", _BOUND_BAD_INPUT)
def test_bad_input_raises_on_every_rank(bound, name):
    _assert_ok(bound, name)


def test_every_bound_check_ran(bound):
    assert set(bound[0]) == set(_BOUND) | set(_BOUND_BAD_INPUT)


@pytest.mark.parametrize("name", ["device_id/beyond_visible_cards", "bound_to_the_card", "device_mesh_1d",
                                  "fsdp2_on_the_mesh", "deepspeed_zero3_on_the_bound_group",
                                  "new_group/use_local_synchronization"])
def test_cuda_named_code(transfer_nccl, name):
    _assert_ok(transfer_nccl, name)


@pytest.mark.parametrize("name", [f"{round_name}/{check}" for round_name in ("bound", "unbound")
                                  for check in ("device_mesh_2d", "new_group/use_local_synchronization")])
def test_device_mesh_2d(mesh_2d, name):
    _assert_ok(mesh_2d, name)


if __name__ == "__main__":
    serve_rank(globals())
