"""Sharing supa tensors and events between processes through torch.multiprocessing.

As with CUDA IPC, a supa tensor sent through a queue or a pipe arrives on the same device with
the same data, and both processes see each other's writes (they map the same memory). What
cannot be shared raises while the sender pickles.
"""

import gc
import multiprocessing.reduction
import os
import pickle
import stat

import pytest
import torch
import torch.multiprocessing as mp

from harness import fresh_process

pytestmark = pytest.mark.skipif(not torch.supa.is_available() or torch.supa.device_count() < 2,
                                reason="needs two supa devices")


@pytest.fixture(autouse=True)
def _the_cards_memory_as_found():
    """Each test leaves the cards' memory as it found it: a shared block that no receiver took over
    stays allocated (as with CUDA IPC), and the test process's later tests (test_memory.py's segment
    layouts) would find it there."""
    before = [torch.supa.memory_allocated(d) for d in range(torch.supa.device_count())]
    yield
    gc.collect()
    torch.supa.ipc_collect()
    assert [torch.supa.memory_allocated(d) for d in range(torch.supa.device_count())] == before


# The parents below run in fresh interpreters (harness.fresh_process), their children in processes of
# their own. Every blocking call has a timeout, so a lost message fails the test instead of hanging it.
T = 60


def _exchange_child(q, back, conn):
    t = q.get(timeout=T)                                 # queue: a whole tensor
    back.put(("got", str(t.device), t.dtype, t.tolist()))
    t[0] = 100.0                                         # write visible in the parent?
    back.put("written")
    assert q.get(timeout=T) == "parent wrote"
    back.put(("sees parent", t[1].item()))
    view = conn.recv()                                   # pipe: a strided view of the same storage
    back.put(("view", view.tolist(), view.storage_offset(), view.stride(),
              view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()))
    ints, bf16, param, cpu = conn.recv()
    back.put(("more", ints.tolist(), ints.dtype, bf16.float().tolist(), bf16.dtype,
              type(param).__name__, param.requires_grad, param.device.index, cpu.device.type, cpu.tolist()))
    event = conn.recv()
    back.put(("event", type(event).__name__, event.query()))
    conn.send(t[2:4])                                    # back to the parent: it knows this memory
    assert q.get(timeout=T) == "done"


def _exchange_with_a_child(method: str) -> None:
    ctx = mp.get_context(method)
    q, back = ctx.Queue(), ctx.Queue()
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_exchange_child, args=(q, back, child_end), daemon=True)
    p.start()
    x = torch.arange(12, dtype=torch.float32, device="supa:1")
    q.put(x)
    assert back.get(timeout=T) == ("got", "supa:1", torch.float32, [float(i) for i in range(12)])
    assert back.get(timeout=T) == "written"
    assert x[0].item() == 100.0                          # the child's write
    x[1] = -7.0
    q.put("parent wrote")
    assert back.get(timeout=T) == ("sees parent", -7.0)  # the parent's write
    # x.view(3, 4)[1:, 1::2]: rows 1..2, columns 1 and 3, over the same storage.
    parent_end.send(x.view(3, 4)[1:, 1::2])
    assert back.get(timeout=T) == ("view", [[5.0, 7.0], [9.0, 11.0]], 5, (4, 2), True)
    ints = torch.tensor([5, -6, 7], device="supa:1")
    bf16 = torch.tensor([0.5, 1.5], dtype=torch.bfloat16, device="supa:0")
    param = torch.nn.Parameter(torch.ones(2, device="supa:1"))
    parent_end.send((ints, bf16, param, torch.tensor([1, 2])))
    assert back.get(timeout=T) == ("more", [5, -6, 7], torch.int64, [0.5, 1.5], torch.bfloat16,
                                   "Parameter", True, 1, "cpu", [1, 2])
    event = torch.supa.Event(interprocess=True)
    event.record()
    parent_end.send(event)
    assert back.get(timeout=T) == ("event", "Event", True)
    assert parent_end.poll(T)
    back_view = parent_end.recv()
    # The view the child sends back is the parent's own memory again.
    assert back_view.tolist() == [2.0, 3.0]
    assert back_view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    q.put("done")
    p.join(T)
    assert p.exitcode == 0


@pytest.mark.emulation_only
@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.slow  # several fresh interpreters doing real work
def test_tensors_cross_processes_on_the_same_device_and_share_memory(method):
    fresh_process(_exchange_with_a_child, method, timeout=400)


def _spawned_worker(rank, t):
    assert t.device == torch.device("supa", 1), t.device
    t[rank] = rank + 10


def _spawn_two_workers_on_one_tensor() -> None:
    x = torch.zeros(2, device="supa:1")
    mp.spawn(_spawned_worker, args=(x,), nprocs=2, join=True)
    assert x.tolist() == [10.0, 11.0]


@pytest.mark.emulation_only
@pytest.mark.slow  # several fresh interpreters doing real work
def test_torch_multiprocessing_spawn_args_share_memory():
    fresh_process(_spawn_two_workers_on_one_tensor, timeout=400)


# Memory accounting across processes: the sender keeps counting a block it sent until the
# receiver has let go of it (CUDA's IPC limbo), then ipc_collect frees it.
def _holding_child(conn):
    t = conn.recv()
    conn.send("holding")
    assert conn.recv() == "release"
    del t
    conn.send("released")
    conn.recv()


def _send_and_count() -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_holding_child, args=(b,), daemon=True)
    p.start()
    base = torch.supa.memory_allocated(0)
    x = torch.ones(1 << 18, device="supa:0")        # 1 MiB
    size = torch.supa.memory_allocated(0) - base
    a.send(x)
    assert a.poll(T) and a.recv() == "holding"
    assert torch.supa.memory_allocated(0) - base == size, "shared"
    del x
    torch.supa.ipc_collect()
    assert torch.supa.memory_allocated(0) - base == size, "sender freed, receiver holds"
    a.send("release")
    assert a.poll(T) and a.recv() == "released"
    torch.supa.ipc_collect()
    assert torch.supa.memory_allocated(0) - base == 0, "all released"
    a.send("bye")
    p.join(T)


@pytest.mark.emulation_only
@pytest.mark.slow  # several fresh interpreters doing real work
def test_sender_counts_shared_memory_until_the_receiver_releases_it():
    fresh_process(_send_and_count, timeout=400)


# ---------------------------------------------------------------------------------------------
# In-process checks of the reductions (pickling as torch.multiprocessing does).

def _roundtrip(obj):
    return pickle.loads(multiprocessing.reduction.ForkingPickler.dumps(obj))


def test_non_leaf_tensor_requiring_grad_raises_in_the_sender():
    x = torch.ones(3, device="supa:0", requires_grad=True) * 2
    a, b = mp.Pipe()
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor which requires_grad"):
        a.send(x)
    assert not b.poll(0.5)  # nothing half-sent
    a.send(x.detach())
    assert torch.equal(b.recv().cpu(), torch.full((3,), 2.0))


def test_supa_storage_alone_cannot_be_pickled():
    x = torch.ones(3, device="supa:0")
    with pytest.raises(RuntimeError, match="Cannot pickle NPU storage; try pickling a NPU tensor instead"):
        multiprocessing.reduction.ForkingPickler.dumps(x.untyped_storage())
    with pytest.raises(RuntimeError, match="Cannot pickle NPU storage"):
        multiprocessing.reduction.ForkingPickler.dumps(x.storage())


def test_event_needs_interprocess_and_a_record_to_be_sent():
    with pytest.raises(RuntimeError, match="interprocess=True"):
        multiprocessing.reduction.ForkingPickler.dumps(torch.supa.Event())
    with pytest.raises(RuntimeError, match="recorded"):
        multiprocessing.reduction.ForkingPickler.dumps(torch.supa.Event(interprocess=True))
    event = torch.supa.Event(interprocess=True)
    event.record(torch.supa.current_stream(1))
    copy = _roundtrip(event)
    assert isinstance(copy, torch.supa.Event) and copy.query() and copy.device == torch.device("supa", 1)


def test_roundtrip_in_one_process_gives_back_the_same_memory():
    x = torch.arange(10.0, device="supa:1")
    y = _roundtrip(x[3:7])
    assert y.device == torch.device("supa", 1)
    assert y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    y[0] = 42.0
    assert x[3].item() == 42.0


def test_float64_made_on_the_device_can_be_shared():
    x = torch.arange(3, dtype=torch.float64, device="supa:0") / 3   # no host->device copy
    y = _roundtrip(x)
    assert y.dtype == torch.float64 and torch.equal(y.cpu(), torch.arange(3, dtype=torch.float64) / 3)


def test_complex_conj_and_empty_tensors_keep_their_meaning():
    z = torch.tensor([1 + 2j, 3 - 4j], device="supa:0")
    back = _roundtrip(z.conj())
    # (Reading a conj view back to the CPU is a separate open problem of the emulator; check the
    # bit and the memory.)
    assert back.is_conj() and back.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()
    empty = _roundtrip(torch.empty(0, 3, device="supa:1"))
    assert empty.shape == (0, 3) and empty.device == torch.device("supa", 1)


@pytest.mark.emulation_only
def test_sharing_keeps_statistics_and_data_and_limbo_waits_for_receivers():
    # The figures below are differences of memory_allocated(): an earlier test's cyclic garbage
    # freed by a collection in the middle would move them.
    gc.collect()
    torch.supa.ipc_collect()
    base = torch.supa.memory_allocated(0)
    x = torch.arange(1 << 16, dtype=torch.float32, device="supa:0")
    view = x[10:20]
    size = torch.supa.memory_allocated(0) - base
    core = torch.supa._native()

    assert not core._ipc_is_shared(x.untyped_storage())
    messages = [multiprocessing.reduction.ForkingPickler.dumps(view) for _ in range(3)]  # moves x once
    assert core._ipc_is_shared(x.untyped_storage())
    assert torch.supa.memory_allocated(0) - base == size
    assert torch.equal(x.cpu(), torch.arange(1 << 16, dtype=torch.float32))
    del x, view
    torch.supa.ipc_collect()
    # Messages are in flight: the memory stays allocated, as CUDA keeps IPC blocks in limbo.
    assert torch.supa.memory_allocated(0) - base == size
    received = [pickle.loads(m) for m in messages]    # the first maps the block, the others reuse it
    assert received[0].untyped_storage().data_ptr() == received[2].untyped_storage().data_ptr()
    assert torch.equal(received[1].cpu(), torch.arange(10, 20, dtype=torch.float32))
    torch.supa.ipc_collect()
    assert torch.supa.memory_allocated(0) - base == size
    del received
    torch.supa.ipc_collect()
    assert torch.supa.memory_allocated(0) == base


def test_storage_ipc_methods():
    x = torch.arange(4.0, device="supa:1")
    device, fd, nbytes = x.untyped_storage()._share_supa_()
    assert (device, nbytes) == (1, 16) and fd >= 0
    other = torch.UntypedStorage._new_shared_supa(device, fd, nbytes)
    assert other.device == torch.device("supa", 1) and other.nbytes() == 16
    t = torch.empty(0, device="supa:1").set_(other, 0, (4,), (1,))
    t[3] = 9.0
    assert x[3].item() == 9.0
    with pytest.raises(RuntimeError, match="not resizable"):
        other.resize_(32)
    with pytest.raises(RuntimeError, match="only available on SUPA"):
        torch.ones(2).untyped_storage()._share_supa_()


def test_cpu_tensors_still_use_torch_sharing():
    t = torch.arange(3)
    assert torch.equal(_roundtrip(t), t)


def test_a_message_outlives_a_resize_of_the_sent_storage():
    x = torch.arange(4.0, device="supa:0")
    message = multiprocessing.reduction.ForkingPickler.dumps(x)
    x.untyped_storage().resize_(64)   # new memory for the sender: the sharing stops there
    x[0] = 7.0
    y = pickle.loads(message)
    assert y.tolist() == [0.0, 1.0, 2.0, 3.0] and x.tolist() == [7.0, 1.0, 2.0, 3.0]


def test_shared_device_memory_is_readable_and_writable_by_its_owner_only():
    x = torch.arange(4.0, device="supa:0")
    _, fd, _ = x.untyped_storage()._share_supa_()
    info = os.fstat(fd)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    x.untyped_storage()._release_ipc_counter_supa()  # no receiver will take over the pending reference
