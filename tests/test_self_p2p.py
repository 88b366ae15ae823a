"""Sends to and receives from one's own rank on bccl, as NCCL allows (gloo refuses them).

One fresh process with a group of one rank (a rank's own peer needs no other process); the
exchange with other ranks inside a batch_isend_irecv runs in torch's own
test_batch_isend_irecv_nccl / _self_nccl (test_torch_distributed.py).
"""

import pytest
from harness import shared_case

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

_SCENARIO = """
    import json
    import torch
    import torch.distributed as dist

    dist.init_process_group("bccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    dev = torch.device("supa", 0)
    results = {}

    # batch_isend_irecv with the receive first, as torch's tests issue them
    sent = torch.arange(6, dtype=torch.float32, device=dev).reshape(2, 3)
    received = torch.full((2, 3), -1.0, device=dev)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, 0), dist.P2POp(dist.isend, sent, 0)])
    sent.add_(100)  # after the send was issued: the receiver gets the data as it was then
    for work in works:
        work.wait()
    results["batch"] = received.cpu().tolist()

    # one tag's messages arrive in order; tags do not mix (torch allows self p2p only in batches)
    def batch(*ops):
        for work in dist.batch_isend_irecv([dist.P2POp(op, tensor, 0, tag=tag) for op, tensor, tag in ops]):
            work.wait()

    batch(*[(dist.isend, torch.full((2,), value, device=dev), tag) for value, tag in ((1.0, 7), (2.0, 7), (3.0, 8))])
    outs = [torch.empty(2, device=dev) for _ in range(3)]
    batch(*[(dist.irecv, out, tag) for out, tag in zip(outs, (8, 7, 7))])
    results["order"] = [out[0].item() for out in outs]

    def error_of(fn):
        try:
            fn()
        except RuntimeError as error:
            return str(error)
        return None

    results["unmatched"] = error_of(lambda: batch((dist.irecv, torch.empty(2, device=dev), 9)))
    batch((dist.isend, torch.zeros(3, device=dev), 10))
    results["mismatch"] = error_of(lambda: batch((dist.irecv, torch.empty(2, device=dev), 10)))
    dist.destroy_process_group()
    print("RESULT " + json.dumps(results))
"""


_RUN = shared_case(f"{__name__}: the scenario", _SCENARIO, env={"SUPA_EMULATE": "1"})


@pytest.fixture(scope="module")
def outcome():
    return _RUN.scenario_result()


def test_batch_exchange_with_itself_delivers_the_data_as_sent(outcome):
    assert outcome["batch"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_messages_of_a_tag_arrive_in_order(outcome):
    assert outcome["order"] == [3.0, 1.0, 2.0]


@pytest.mark.emulation_only
def test_receive_without_its_send_raises_instead_of_hanging(outcome):
    assert "before its matching send was issued" in outcome["unmatched"]


@pytest.mark.emulation_only
def test_receive_of_another_shape_raises(outcome):
    assert "expects (2,)" in outcome["mismatch"] and "sent (3,)" in outcome["mismatch"]
