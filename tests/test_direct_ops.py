"""The direct (unboxed) supa kernels of the hottest in-place ops give the CPU result and the fallback's errors.

add_, sub_, mul_, div_, fill_ and zero_ have kernels of their own that skip the boxed fallback in
the plain case; every other case (CPU operands that are not scalars, other devices, aliasing
views, graph capture) must behave exactly as before. The reference is the same op on CPU tensors.
"""

import re

import pytest
import torch

pytestmark = pytest.mark.emulation_only  # tests the emulator's own kernels

DEV = torch.device("supa", 0)


def _both(make):
    """The same starting tensors on CPU and on supa."""
    cpu = make()
    return cpu, [t.to(DEV) for t in cpu]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("call", [
    lambda a, b: a.add_(b),
    lambda a, b: a.add_(b, alpha=3),
    lambda a, b: a.sub_(b, alpha=2),
    lambda a, b: a.mul_(b),
    lambda a, b: a.add_(2),           # a Python number: a wrapped 0-dim CPU tensor
    lambda a, b: a.mul_(0.5),
    lambda a, b: a.sub_(1, alpha=2),
    lambda a, b: a.add_(b[0]),        # a 0-dim supa tensor, broadcast
    lambda a, b: a.mul_(b[:, :1]),    # a strided view of another tensor, broadcast
    lambda a, b: a[:, 1:].add_(a[:, :1]),  # both operands views of one storage
    lambda a, b: a.t().mul_(b.t()),   # transposed self
    lambda a, b: a.fill_(7),
    lambda a, b: a[1].zero_(),
])
def test_in_place_ops_match_cpu(call, dtype):
    def make():
        torch.manual_seed(0)
        return [(torch.randn(4, 5) * 10).to(dtype), (torch.randn(4, 5) * 10).to(dtype)]
    (a_cpu, b_cpu), (a, b) = _both(make)
    try:
        result_cpu = call(a_cpu, b_cpu)
    except RuntimeError as error:  # e.g. a float factor on an int tensor: the same error on supa
        with pytest.raises(RuntimeError, match=re.escape(str(error))):
            call(a, b)
        torch.testing.assert_close(a.cpu(), a_cpu)
        return
    result = call(a, b)
    assert result.device == DEV
    assert result.shape == result_cpu.shape and result.stride() == result_cpu.stride()
    torch.testing.assert_close(a.cpu(), a_cpu)
    torch.testing.assert_close(b.cpu(), b_cpu)


def test_in_place_op_returns_self():
    a = torch.ones(3, device=DEV)
    assert a.add_(1) is a and a.mul_(a) is a and a.fill_(0) is a and a.zero_() is a


def test_true_division_in_place():
    a, b = torch.arange(1.0, 7.0, device=DEV), torch.full((6,), 4.0, device=DEV)
    a.div_(b)
    torch.testing.assert_close(a.cpu(), torch.arange(1.0, 7.0) / 4)


@pytest.mark.parametrize("op", ["add_", "sub_", "mul_", "div_"])
def test_cpu_operand_that_is_not_a_scalar_is_refused(op):
    a = torch.ones(3, device=DEV)
    with pytest.raises(RuntimeError, match=rf"same device.*supa:0 and cpu.*argument 'other' of aten::{op}"):
        getattr(a, op)(torch.ones(3))
    torch.testing.assert_close(a.cpu(), torch.ones(3))


def test_operand_on_another_card_is_refused():
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    a = torch.ones(3, device="supa:0")
    with pytest.raises(RuntimeError, match="same device.*supa:0 and supa:1"):
        a.add_(torch.ones(3, device="supa:1"))


def test_runs_on_the_operands_card_and_leaves_the_current_device_alone():
    if torch.supa.device_count() < 2:
        pytest.skip("needs 2 SUPA cards")
    a = torch.zeros(3, device="supa:1")
    with torch.supa.device(0):
        a.add_(1).mul_(torch.full((3,), 3.0, device="supa:1"))
        assert torch.supa.current_device() == 0
    torch.testing.assert_close(a.cpu(), torch.full((3,), 3.0))


def test_autograd_sees_the_in_place_update():
    x = torch.randn(4, device=DEV, requires_grad=True)
    y = x * 1
    y.mul_(3).add_(1)
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), torch.full((4,), 3.0))


def test_ops_are_recorded_by_graph_capture():
    static = torch.zeros(4, device=DEV)
    graph = torch.supa.SUPAGraph()
    with torch.supa.graph(graph):
        static.add_(1).mul_(2)
    static.fill_(1)
    graph.replay()
    torch.testing.assert_close(static.cpu(), torch.full((4,), 4.0))
