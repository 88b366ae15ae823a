"""The card's BLAS workspaces: what a matrix product leaves allocated, per (thread, stream), as cuBLAS
does on a GPU (tests/data/fidelity/h200_kernels.json, "blas_workspace_bytes")."""

import gc
import threading
import time

import pytest

from harness import ANY, fresh_process
from test_half_precision_products import assert_a_float32_sum_rounded_once
import torch
import torch.nn.functional as F

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

MiB = 1 << 20
WORKSPACE = 32 * MiB  # the default profile's (an H200's cuBLAS workspace)
LT_WORKSPACE = 1 * MiB  # the bias-epilogue path's
SLACK = 4096  # blocks are padded and rounded to 512 bytes (test_memory.py): the results' and the workspaces'


@pytest.fixture
def dev():
    torch.supa.init()
    gc.collect()
    torch.supa._clear_sublas_workspaces()
    yield torch.supa.device_count() - 1
    torch.supa._clear_sublas_workspaces()


def held_by(fn, dev):
    """Bytes the call leaves allocated on `dev` beyond the tensors it returns."""
    before = torch.supa.memory_allocated(dev)
    results = fn()
    after = torch.supa.memory_allocated(dev)
    return after - before - sum(r.untyped_storage().nbytes() for r in results)


def workspaces(n, lt=0):
    """The bytes n workspaces and lt bias-epilogue workspaces count for, up to the blocks' rounding."""
    return pytest.approx(n * WORKSPACE + lt * LT_WORKSPACE, abs=SLACK)


def matrices(dev, dtype=torch.bfloat16):
    return torch.randn(256, 256, device=f"supa:{dev}", dtype=dtype), torch.randn(256, device=f"supa:{dev}", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_first_matrix_product_keeps_one_workspace_and_later_ones_none(dev, dtype):
    x, _ = matrices(dev, dtype)
    allocations = torch.supa.memory_stats(dev)["allocation.all.current"]
    assert held_by(lambda: [x @ x], dev) == workspaces(1)
    assert torch.supa.memory_stats(dev)["allocation.all.current"] == allocations + 1  # the result is gone, not the workspace
    assert held_by(lambda: [x @ x, torch.bmm(x[None], x[None]), torch.addmv(x[0], x, x[1])], dev) == workspaces(0)


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "matmul",
                                "linear", "einsum"])
def test_every_blas_operator_takes_the_workspace(dev, op):
    x, v = matrices(dev, torch.float32)
    call = {
        "mm": lambda: torch.mm(x, x), "addmm": lambda: torch.addmm(x, x, x), "bmm": lambda: torch.bmm(x[None], x[None]),
        "baddbmm": lambda: torch.baddbmm(x[None], x[None], x[None]), "addbmm": lambda: torch.addbmm(x, x[None], x[None]),
        "addmv": lambda: torch.addmv(v, x, v), "mv": lambda: torch.mv(x, v), "dot": lambda: torch.dot(v, v),
        "vdot": lambda: torch.vdot(v, v), "matmul": lambda: x[None] @ x, "linear": lambda: F.linear(x, x),
        "einsum": lambda: torch.einsum("ij,jk->ik", x, x),
    }[op]
    assert held_by(lambda: [call()], dev) == workspaces(1)


def test_a_product_of_empty_operands_takes_no_workspace(dev):
    empty = torch.empty(4, 0, device=f"supa:{dev}")
    assert held_by(lambda: [empty @ empty.t()], dev) == workspaces(0)


def test_a_bias_vector_takes_the_epilogue_path_and_its_extra_workspace(dev):
    x, bias = matrices(dev)
    assert held_by(lambda: [F.linear(x, x, bias)], dev) == workspaces(1, lt=1)
    torch.supa._clear_sublas_workspaces()
    # Not the epilogue: a full bias matrix, a beta other than 1, in place into the bias.
    assert held_by(lambda: [torch.addmm(x, x, x), torch.addmm(bias, x, x, beta=0.5)], dev) == workspaces(1)
    assert held_by(lambda: [bias.expand(256, 256).clone().addmm_(x, x)], dev) == workspaces(0)


def test_each_stream_and_each_thread_has_its_own_workspace(dev):
    x, _ = matrices(dev)
    side = torch.supa.Stream(dev)

    def on_side_stream():
        with torch.supa.stream(side):
            return [x @ x]

    assert held_by(lambda: [x @ x] + on_side_stream(), dev) == workspaces(2)
    results = []
    handles = []

    def on_a_thread():
        with torch.supa.device(dev):
            handles.append(torch.supa.current_blas_handle())
            results.append(x @ x)

    def on_threads(count):
        for _ in range(count):
            thread = threading.Thread(target=on_a_thread)
            thread.start()
            thread.join()
            # join() returns when the Python thread is done; its C++ thread-locals (the handle it
            # gives back) are destroyed as the OS thread exits, a moment later.
            time.sleep(0.2)
        return results[-count:]

    assert held_by(lambda: on_threads(1), dev) == workspaces(1)
    # A thread that has ended gives its handle back: the next thread reuses it, and its workspace.
    assert held_by(lambda: on_threads(2), dev) == workspaces(0)
    assert len(set(handles)) == 1
    with torch.supa.device(dev):
        assert torch.supa.current_blas_handle() not in handles


def test_backward_uses_autograd_s_handle_so_a_training_step_holds_two(dev):
    x, _ = matrices(dev, torch.float32)
    w = torch.randn(256, 256, device=f"supa:{dev}", requires_grad=True)

    def forward_and_backward():
        (x @ w).sum().backward()
        return [w.grad]

    assert held_by(forward_and_backward, dev) == workspaces(2)
    w.grad = None
    assert held_by(forward_and_backward, dev) == workspaces(0)


def _held_by_a_backward() -> int:
    """Bytes a backward leaves allocated beyond the gradient (its BLAS workspaces)."""
    x = torch.randn(256, 256, device="supa")
    w = torch.randn(256, 256, device="supa", requires_grad=True)
    before = torch.supa.memory_allocated()
    (x @ w).sum().backward()
    return torch.supa.memory_allocated() - before - w.grad.untyped_storage().nbytes()


_DEVICE_THREADS = fresh_process(_held_by_a_backward, env={"SUPA_EMULATE": "1", "SUPA_EMU_AUTOGRAD_DEVICE_THREADS": "1"},
                                shared=ANY)


def test_backward_on_autograd_s_device_threads_holds_the_same():
    assert _DEVICE_THREADS.result().value == workspaces(2)


def _held_by_a_product() -> int:
    """Bytes a matrix product leaves allocated beyond its result (its BLAS workspace)."""
    x = torch.randn(64, 64, device="supa")
    before = torch.supa.memory_allocated()
    y = x @ x
    return torch.supa.memory_allocated() - before - y.untyped_storage().nbytes()


_CONFIGURED = fresh_process(_held_by_a_product, env={"SUPA_EMULATE": "1", "SUPA_EMU_SUBLAS_WORKSPACE_CONFIG": ":16:8"},
                            shared=ANY)


def test_the_workspace_size_is_configurable_as_cublas_s():
    assert _CONFIGURED.result().value == pytest.approx(128 << 10, abs=SLACK)


def test_clearing_frees_every_workspace_and_the_next_product_takes_one_again(dev):
    x, bias = matrices(dev)
    F.linear(x, x, bias)
    before = torch.supa.memory_allocated(dev)
    torch.supa._clear_sublas_workspaces()
    assert before - torch.supa.memory_allocated(dev) == workspaces(1, lt=1)
    assert held_by(lambda: [x @ x], dev) == workspaces(1)


def test_the_real_stack_s_names_and_cuda_s_under_the_transfer(dev):
    import torch_supa._C

    x, _ = matrices(dev)
    x @ x
    before = torch.supa.memory_allocated(dev)
    torch_supa._C._supa_clearSublasWorkspaces()
    assert before - torch.supa.memory_allocated(dev) == workspaces(1)
    with torch.supa.device(dev):
        assert torch_supa._C._supa_getCurrentBlasHandle() == torch.supa.current_blas_handle() != 0
    if torch.supa.is_available() and getattr(torch._C, "_cuda_clearCublasWorkspaces", None) is not None and \
            torch.cuda.current_blas_handle is torch.supa.current_blas_handle:
        x @ x
        before = torch.supa.memory_allocated(dev)
        torch._C._cuda_clearCublasWorkspaces()
        assert before - torch.supa.memory_allocated(dev) == workspaces(1)


def test_workspaces_are_named_in_memory_snapshots(dev):
    x, bias = matrices(dev)
    F.linear(x, x, bias)
    names = [block["frames"][0]["name"] for segment in torch.supa.memory_snapshot() if segment["device"] == dev
             for block in segment["blocks"] if block["frames"]]
    assert sum(name.startswith("supa BLAS workspace") for name in names) == 1
    assert sum(name.startswith("supa BLAS Lt workspace") for name in names) == 1


def test_graph_capture_uses_the_capture_stream_s_workspace_and_replay_takes_none(dev):
    x, _ = matrices(dev)
    graph = torch.supa.SUPAGraph()
    with torch.supa.device(dev):
        stream = torch.supa.Stream()
    # Made outside `device(dev)`: the first torch.supa.graph also makes the class's default capture
    # stream on the device current then (as torch.cuda.graph does), and later tests capture on it.
    capture = torch.supa.graph(graph, stream=stream)
    with torch.supa.device(dev):
        with capture:
            y = x @ x
        kept = torch.supa.memory_allocated(dev)
        assert any(block["frames"] and block["frames"][0]["name"].startswith("supa BLAS workspace")
                   and segment["segment_pool_id"] == graph.pool()
                   for segment in torch.supa.memory_snapshot() if segment["device"] == dev
                   for block in segment["blocks"])
        x.mul_(2)
        graph.replay()
        assert torch.supa.memory_allocated(dev) == kept
        torch.testing.assert_close(y, x @ x)
        del graph, y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_matrix_product_s_peak_is_its_result_as_on_a_card(dev, dtype):
    # The CPU kernel's conversion and packing buffers (4 MiB here in bf16) are not the card's: a card's
    # BLAS needs nothing beyond its workspace (docs/operator_memory.md, "Kernel scratch by operator family").
    g = torch.randn(512, 4096, device=f"supa:{dev}", dtype=dtype)
    w = torch.randn(4096, 1024, device=f"supa:{dev}", dtype=dtype)
    g @ w  # the workspace
    torch.supa.reset_peak_memory_stats(dev)
    result = g @ w
    assert torch.supa.max_memory_allocated(dev) == torch.supa.memory_allocated(dev)
    if dtype == torch.float32:
        torch.testing.assert_close(result.cpu(), g.cpu() @ w.cpu(), rtol=0, atol=0)
    else:  # float32 accumulation in the order of the host's path, rounded once
        assert_a_float32_sum_rounded_once(result.cpu(), torch.mm, [g.cpu(), w.cpu()], 4096)
