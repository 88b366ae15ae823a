"""The cross-rank signature exchange of bccl, over both carriers.

Ranks run as threads of this process sharing a HashStore. The cross-host carrier (GlooExchange)
is what bccl uses when a group spans hosts; here the host identity each rank reports is replaced
per thread (the test-only seam `_host_identity`) so that two ranks on this machine look like two
hosts, and the whole process group runs through it.
"""

import datetime
import os
import stat
import threading

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

from supa_emu.distributed.gloo import signature_exchange  # noqa: E402
from supa_emu.distributed.process_group import ProcessGroupBCCL  # noqa: E402
from supa_emu.distributed.gloo.signature_exchange import CollectiveMismatchError, GlooExchange  # noqa: E402

pytestmark = pytest.mark.emulation_only

WORLD = 2
TIMEOUT = datetime.timedelta(seconds=60)


def _run_ranks(body):
    """Run body(rank, store) in WORLD threads; return their results, re-raising the first failure."""
    store = dist.HashStore()
    results, errors = [None] * WORLD, []

    def run(rank):
        try:
            results[rank] = body(rank, store)
        except BaseException as error:  # reported to the test below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def ranks_on_separate_hosts(monkeypatch):
    host = threading.local()
    monkeypatch.setattr(signature_exchange, "_host_identity", lambda: f"host-{host.rank}")
    return host


def test_gloo_exchange_gives_every_rank_all_signatures():
    def body(rank, store):
        exchange = GlooExchange(store, rank, WORLD, TIMEOUT)
        try:
            return [exchange.exchange([rank, 7, 100 + rank]) for _ in range(3)]
        finally:
            exchange.close()

    results = _run_ranks(body)
    for per_rank in results:
        for everyone in per_rank:
            assert [words[:3] for words in everyone] == [[0, 7, 100], [1, 7, 101]]
            assert all(len(words) == signature_exchange.WORDS for words in everyone)
            assert all(set(words[3:]) == {0} for words in everyone)


def test_gloo_exchange_reports_a_peer_that_never_comes_as_dist_backend_error():
    peer_may_leave = threading.Event()

    def body(rank, store):
        exchange = GlooExchange(store, rank, WORLD, datetime.timedelta(seconds=2))
        if rank == 1:
            peer_may_leave.wait(60)  # connected, but never joins the exchange
            return None
        try:
            with pytest.raises(dist.DistBackendError, match="(?i)timed out"):
                exchange.exchange([0, 7])
        finally:
            peer_may_leave.set()

    _run_ranks(body)


def test_groups_on_one_host_use_shared_memory_and_across_hosts_use_gloo(ranks_on_separate_hosts, monkeypatch):
    def body(rank, store):
        ranks_on_separate_hosts.rank = rank
        carrier = signature_exchange.create(store, rank, WORLD, TIMEOUT, "'test'")
        carrier.close()
        return type(carrier)

    assert _run_ranks(body) == [GlooExchange, GlooExchange]

    def same_host(rank, store):
        carrier = signature_exchange.create(store, rank, WORLD, TIMEOUT, "'test'")
        carrier.close()
        return type(carrier)

    monkeypatch.setattr(signature_exchange, "_host_identity", lambda: "one-host")
    assert _run_ranks(same_host) == [signature_exchange.SharedMemoryBoard] * WORLD


def test_process_group_across_hosts_runs_collectives_and_rejects_mismatches(ranks_on_separate_hosts):
    if torch.supa.device_count() < WORLD:
        pytest.skip("needs two SUPA devices")

    def body(rank, store):
        ranks_on_separate_hosts.rank = rank
        options = ProcessGroupBCCL.Options()
        options._timeout = TIMEOUT
        group = ProcessGroupBCCL(store, rank, WORLD, options)
        try:
            assert isinstance(group._transport._agreement._exchange, GlooExchange)
            device = torch.device("supa", rank)
            x = torch.full((4,), float(rank + 1), device=device)
            group.allreduce([x]).wait()
            try:
                group.allreduce([torch.ones(4 if rank == 0 else 8, device=device)]).wait()
            except CollectiveMismatchError as error:
                mismatch = str(error)
            else:
                mismatch = None
            # The group stays usable after a rejected call.
            y = torch.ones(2, device=device)
            group.allreduce([y]).wait()
            return x.cpu(), mismatch, y.cpu()
        finally:
            group.shutdown()

    for summed, mismatch, after in _run_ranks(body):
        assert torch.equal(summed, torch.full((4,), 3.0))
        assert mismatch is not None and "numel=4" in mismatch and "numel=8" in mismatch
        assert torch.equal(after, torch.full((2,), 2.0))


def test_board_counts_a_collective_whose_launch_failed_after_posting():
    """A native launch that posted its signature and then failed (gloo refusing to start in an
    aborted group) has still used its collective number: the next collective lines up with the
    peers' next one instead of overwriting the failed one's slot."""
    def body(rank, store):
        board = signature_exchange.SharedMemoryBoard(store, rank, WORLD, TIMEOUT, "'test'")
        try:
            def posts_then_fails(native, k, words, head):
                native.post(k, words, head)
                raise RuntimeError("gloo refused to start")

            if rank == 0:
                with pytest.raises(RuntimeError, match="refused to start"):
                    board.post([1, 2], 0, posts_then_fails)
            else:
                board.post([1, 2], 0)
            k, status, _ = board.post([3, 4], 0)
            return k, status, board.signature(1 - rank, k, 2)
        finally:
            board.close()

    assert _run_ranks(body) == [(2, 2, [3, 4])] * WORLD


def test_the_shared_memory_board_is_readable_and_writable_by_its_owner_only(monkeypatch):
    """Another user on the host must not read or forge the signatures of a group's collectives."""
    created = []
    real_mkstemp = signature_exchange.tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        fd, path = real_mkstemp(*args, **kwargs)
        info = os.fstat(fd)
        created.append((path, stat.S_IMODE(info.st_mode), info.st_uid))
        return fd, path

    monkeypatch.setattr(signature_exchange.tempfile, "mkstemp", mkstemp)

    def body(rank, store):
        signature_exchange.SharedMemoryBoard(store, rank, WORLD, TIMEOUT, "'test'").close()

    _run_ranks(body)
    assert [(path.startswith("/dev/shm/"), mode, uid) for path, mode, uid in created] == [(True, 0o600, os.geteuid())]
