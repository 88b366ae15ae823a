"""Sends to and receives from one's own rank on bccl, as NCCL allows (gloo refuses them).

Each body runs in a rank of a group of one (harness.distributed_test: a rank's own peer needs no
other process); the exchange with other ranks inside a batch_isend_irecv runs in torch's own
test_batch_isend_irecv_nccl / _self_nccl (test_torch_distributed.py).
"""

import pytest
from ranks import distributed_test
import torch
import torch.distributed as dist

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")


def _batch(*ops) -> None:
    """One batch_isend_irecv with this rank of (op, tensor, tag), waited for (torch allows self p2p
    only in batches)."""
    for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, 0, tag=tag) for op, tensor, tag in ops]):
        work.wait()


@distributed_test(world=1)
def test_batch_exchange_with_itself_delivers_the_data_as_sent(rank, world):
    # the receive first, as torch's tests issue them
    sent = torch.arange(6, dtype=torch.float32, device="supa").reshape(2, 3)
    received = torch.full((2, 3), -1.0, device="supa")
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, 0), dist.P2POp(dist.isend, sent, 0)])
    sent.add_(100)  # after the send was issued: the receiver gets the data as it was then
    for work in works:
        work.wait()
    assert received.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


@distributed_test(world=1)
def test_messages_of_a_tag_arrive_in_order_and_tags_do_not_mix(rank, world):
    _batch(*[(dist.isend, torch.full((2,), value, device="supa"), tag) for value, tag in ((1.0, 7), (2.0, 7), (3.0, 8))])
    outs = [torch.empty(2, device="supa") for _ in range(3)]
    _batch(*[(dist.irecv, out, tag) for out, tag in zip(outs, (8, 7, 7))])
    assert [out[0].item() for out in outs] == [3.0, 1.0, 2.0]


@pytest.mark.emulation_only
@distributed_test(world=1)
def test_receive_without_its_send_raises_instead_of_hanging(rank, world):
    with pytest.raises(RuntimeError, match="before its matching send was issued"):
        _batch((dist.irecv, torch.empty(2, device="supa"), 9))


@pytest.mark.emulation_only
@distributed_test(world=1)
def test_receive_of_another_shape_raises(rank, world):
    _batch((dist.isend, torch.zeros(3, device="supa"), 10))
    with pytest.raises(RuntimeError, match=r"expects \(2,\).*sent \(3,\)|sent \(3,\).*expects \(2,\)"):
        _batch((dist.irecv, torch.empty(2, device="supa"), 10))
