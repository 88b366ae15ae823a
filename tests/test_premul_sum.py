"""ReduceOp.PREMUL_SUM on bccl: each rank's contribution times its own factor, then summed, as NCCL
computes it (the product rounded to the tensor's dtype; a half input takes a half factor, a bfloat16
input a float one), for all_reduce, reduce, reduce_scatter and reduce_scatter_tensor, with number
and device-tensor factors; and FSDP2 with a gradient divide factor, which reduce-scatters with it.

Each test body runs in every rank (ranks.distributed_test); expected values are computed on the CPU
from every rank's inputs, which each rank can rebuild.
"""

import copy

import pytest
from ranks import distributed_test
import torch
import torch.distributed as dist

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a SUPA card has no float64
FACTORS = (0.5, 1 / 3)  # rank r's factor; 1/3 is not exact in any dtype


def _contribution(rank: int, dtype: torch.dtype, numel: int = 12) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(numel, generator=generator) * 3).to(dtype)


def _premultiplied(rank: int, dtype: torch.dtype, numel: int = 12) -> torch.Tensor:
    """Rank `rank`'s contribution times its factor, computed as NCCL does: in float for the
    16-bit types (the factor rounded to half for half inputs), one rounding to the dtype."""
    factor = FACTORS[rank]
    if dtype == torch.float16:
        factor = torch.tensor(factor, dtype=torch.float16).item()
    return (_contribution(rank, dtype, numel).float() * torch.tensor(factor, dtype=torch.float32)).to(dtype)


def _expected_sum(world: int, dtype: torch.dtype, numel: int = 12) -> torch.Tensor:
    total = _premultiplied(0, dtype, numel)
    for rank in range(1, world):
        total = total + _premultiplied(rank, dtype, numel)
    return total


@distributed_test(world=2)
def test_premul_sum_collectives(rank: int, world: int) -> None:
    device = torch.device("supa", rank)
    for dtype in DTYPES:
        op = dist.ReduceOp.PREMUL_SUM(FACTORS[rank])
        expected = _expected_sum(world, dtype)

        tensor = _contribution(rank, dtype).to(device)
        dist.all_reduce(tensor, op=op)
        assert torch.equal(tensor.cpu(), expected), (dtype, tensor.cpu(), expected)

        # A device-tensor factor, of the dtype NCCL reads it as.
        factor_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
        factor = torch.tensor([FACTORS[rank]], dtype=factor_dtype, device=device)
        tensor = _contribution(rank, dtype).to(device)
        dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(factor))
        assert torch.equal(tensor.cpu(), expected), (dtype, "tensor factor")

        # reduce: the root gets the sum; a non-root's input is left as it was.
        tensor = _contribution(rank, dtype).to(device)
        dist.reduce(tensor, dst=0, op=op)
        assert torch.equal(tensor.cpu(), expected if rank == 0 else _contribution(rank, dtype)), (dtype, "reduce")

        # reduce_scatter_tensor and the list form: each rank's chunk of the sum; inputs untouched.
        numel = 4 * world
        full = _expected_sum(world, dtype, numel)
        mine = full[rank * 4:(rank + 1) * 4]
        source = _contribution(rank, dtype, numel).to(device)
        output = torch.empty(4, dtype=dtype, device=device)
        dist.reduce_scatter_tensor(output, source, op=op)
        assert torch.equal(output.cpu(), mine), (dtype, "reduce_scatter_tensor")
        assert torch.equal(source.cpu(), _contribution(rank, dtype, numel)), "the input was changed"
        output = torch.empty(4, dtype=dtype, device=device)
        dist.reduce_scatter(output, list(source.chunk(world)), op=op)
        assert torch.equal(output.cpu(), mine), (dtype, "reduce_scatter")


@pytest.mark.emulation_only
@distributed_test(world=2)
def test_premul_sum_refusals(rank: int, world: int) -> None:
    device = torch.device("supa", rank)
    # As NCCL: only half, float, bfloat16 and double are premultiplied.
    with pytest.raises(TypeError, match="PreMulSum Data type must be half, float, bfloat16 or double"):
        dist.all_reduce(torch.ones(4, dtype=torch.int32, device=device), op=dist.ReduceOp.PREMUL_SUM(2.0))
    # A tensor factor is read as the input's dtype (float for bfloat16): another dtype is refused.
    wrong = dist._make_nccl_premul_sum(torch.tensor([2.0], dtype=torch.bfloat16, device=device))
    with pytest.raises(RuntimeError, match="expected scalar type Float but found BFloat16"):
        dist.all_reduce(torch.ones(4, dtype=torch.bfloat16, device=device), op=wrong)
    host_factor = dist._make_nccl_premul_sum(torch.tensor([2.0]))
    with pytest.raises(ValueError, match="tensor factor must live on supa"):
        dist.reduce_scatter_tensor(torch.empty(2, device=device), torch.ones(2 * world, device=device),
                                   op=host_factor)
    # The group is still usable after the refusals (they happen before any rank talks to a peer).
    tensor = torch.ones(4, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.PREMUL_SUM(0.5))
    assert torch.equal(tensor.cpu(), torch.full((4,), 0.5 * world))


@pytest.mark.slow
@distributed_test(world=4)
def test_fsdp2_tp_gradient_divide_factor_matches_one_device(rank: int, world: int) -> None:
    """A 2-layer MLP, tensor-parallel over 2 ranks and FSDP2-sharded over 2, with a gradient
    divide factor of 8: the gradients are the single-device ones of (sum of the data-parallel
    losses) / 8, which FSDP2 reduce-scatters with PREMUL_SUM(1/8)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    batches = [torch.randn(4, 16) for _ in range(2)]  # one per data-parallel rank
    factor = 8.0

    mesh = init_device_mesh("supa", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(copy.deepcopy(reference).to("supa"), mesh["tp"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    model.set_gradient_divide_factor(factor)

    dp_rank = mesh["dp"].get_local_rank()
    model(batches[dp_rank].to("supa")).square().sum().backward()
    sum(reference(batch).square().sum() for batch in batches).div(factor).backward()

    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        got = param.grad.full_tensor().cpu()
        torch.testing.assert_close(got, expected.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
