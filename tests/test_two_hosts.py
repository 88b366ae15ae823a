"""Two hosts on one machine: a 2-host x 2-card job, each host with its own hostname and /dev/shm.

Each host is a set of Linux namespaces (`unshare --uts --ipc --mount`: own hostname, own System V
IPC, and a fresh tmpfs on /dev/shm), sharing the machine's network, so the ranks of one host
cannot see the other host's shared memory and bccl must carry a group that spans both hosts over
the network, as it would between real machines. Every host starts its ranks with its own
launcher: torchrun with --nnodes 2, or DeepSpeed's launcher with a two-entry hostfile and
--no_ssh (DeepSpeed's multi-node path without ssh; docs/collectives.md, "Several hosts on one
machine", says why the --launcher choices cannot run here).

Checked: bccl collectives across the hosts and on per-host subgroups (each rank asserts the values
against plain arithmetic), and a ZeRO-3 job whose losses equal those of the same job on 1 host x 4 cards.
Skipped with the reason where namespaces cannot be created (no unshare, or not permitted).
"""

import json
import math
import os
import pathlib
import shutil
import sys

import pytest
import torch

from harness import free_port, fresh_process, print_line, torchrun_command, wait

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_gpt.py"
ZERO3 = ROOT / "examples" / "configs" / "zero3.json"
HOSTS = ("supa-host0", "supa-host1")
CARDS_PER_HOST = 2
JOB_TIMEOUT_S = 900
TRAIN_ARGS = ["--config", str(ZERO3), "--steps", "4", "--seed", "1234", "--log-format", "json"]
_PASSED = "TWO-HOSTS-RANK-PASSED "


def _namespaces_unavailable():
    """Why host namespaces cannot be made here, or None if they can."""
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    probe = fresh_process(["unshare", "--uts", "--ipc", "--mount", "--fork", "sh", "-c",
                           "mount -t tmpfs tmpfs /dev/shm && hostname probe"], timeout=60, check=False)
    if probe.returncode != 0:
        return f"unshare --uts --ipc --mount is not permitted here: {probe.stderr.strip()[:200]}"
    return None


_UNAVAILABLE = _namespaces_unavailable()

pytestmark = [
    pytest.mark.slow,  # three multi-process jobs of four ranks
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE)),
    pytest.mark.skipif(not (hasattr(torch, "supa") and torch.supa.is_available()),
                       reason="needs SUPA cards (real, or emulated with SUPA_EMULATE=1)"),
]


# ------------------------------------------------------------------------------------------------
# Worker side: one rank of the collectives job (started by torchrun), asserting for itself
# ------------------------------------------------------------------------------------------------
def _each_host_has_its_name_and_its_shared_memory(rank, world):
    import socket

    import torch.distributed as dist

    seen = [None] * world
    dist.all_gather_object(seen, [socket.gethostname(), os.stat("/dev/shm").st_dev])
    assert [host for host, _ in seen] == [HOSTS[0]] * 2 + [HOSTS[1]] * 2, seen
    devices = [device for _, device in seen]
    assert devices[0] == devices[1] != devices[2] == devices[3], seen


def _all_reduce(rank, world):
    import torch.distributed as dist

    t = torch.full((1000,), rank + 1.0, device="supa")
    dist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((1000,), world * (world + 1) / 2)), t[:3]


def _all_gather_into_tensor(rank, world):
    import torch.distributed as dist

    out = torch.empty(world * 6, device="supa")
    dist.all_gather_into_tensor(out, torch.arange(6.0, device="supa") + 100 * rank)
    assert torch.equal(out.cpu(), torch.cat([torch.arange(6.0) + 100 * r for r in range(world)])), out


def _reduce_scatter_tensor(rank, world):
    import torch.distributed as dist

    out = torch.empty(3, device="supa")
    dist.reduce_scatter_tensor(out, torch.arange(world * 3.0, device="supa") * (rank + 1))
    expected = torch.arange(rank * 3.0, rank * 3.0 + 3) * sum(r + 1 for r in range(world))
    assert torch.equal(out.cpu(), expected), out


def _broadcast(rank, world):
    import torch.distributed as dist

    t = torch.full((5,), float(rank), device="supa")
    dist.broadcast(t, src=world - 1)
    assert t.cpu().tolist() == [world - 1.0] * 5, t


def _all_to_all_single(rank, world):
    import torch.distributed as dist

    out = torch.empty(world, device="supa")
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32, device="supa") + 10 * rank)
    assert out.cpu().tolist() == [10.0 * r + rank for r in range(world)], out


def _per_host_subgroups(rank, world):
    import torch.distributed as dist

    host_ranks = [list(range(h * CARDS_PER_HOST, (h + 1) * CARDS_PER_HOST)) for h in range(world // CARDS_PER_HOST)]
    group = dist.split_group(split_ranks=host_ranks)
    t = torch.full((4,), float(rank), device="supa")
    dist.all_reduce(t, group=group)
    assert group.size() == CARDS_PER_HOST and t.cpu().tolist() == [float(sum(host_ranks[rank // CARDS_PER_HOST]))] * 4, t


_CHECKS = (_each_host_has_its_name_and_its_shared_memory, _all_reduce, _all_gather_into_tensor, _reduce_scatter_tensor,
           _broadcast, _all_to_all_single, _per_host_subgroups)


def _collectives_worker() -> None:
    """Runs every check in this rank (a failed one ends the job with its traceback), then says so."""
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.accelerator.set_device_index(local)
    dist.init_process_group("bccl", device_id=torch.device("supa", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    for check in _CHECKS:
        check(rank, world)
    dist.barrier()
    dist.destroy_process_group()
    print_line(_PASSED + json.dumps([check.__name__ for check in _CHECKS]))


# ------------------------------------------------------------------------------------------------
# Parent side
# ------------------------------------------------------------------------------------------------
def _on_host(host: int, command) -> list:
    """`command` run as a process of host `host`: in its own UTS, IPC and mount namespaces, with
    the host's own cards."""
    setup = f'mount -t tmpfs tmpfs /dev/shm && hostname {HOSTS[host]} && exec "$@"'
    return ["unshare", "--uts", "--ipc", "--mount", "--fork", "sh", "-c", setup, "sh",
            "env", f"SUPA_EMU_DEVICE_COUNT={CARDS_PER_HOST}", *map(str, command)]


def _run_jobs(commands) -> list:
    """Run `commands` together (the launchers of the hosts), fail with their output unless all
    succeed; return their stdouts."""
    procs = [fresh_process(command, env={"SUPA_EMULATE": "1"}, checkout_first=True, wait=False) for command in commands]
    return [job.require_success().stdout for job in wait(procs, JOB_TIMEOUT_S, what="two-host job")]


def _losses(outputs) -> list:
    events = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith('{"event"')]
    return [event["loss"] for event in events if event["event"] == "step"]


@pytest.fixture(scope="module")
def one_host_losses():
    """The reference: the same ZeRO-3 job on 1 host x 4 cards."""
    losses = _losses(_run_jobs([torchrun_command(EXAMPLE, *TRAIN_ARGS, nproc=4, port=free_port())]))
    assert len(losses) == 4, losses
    return losses


def test_collectives_across_two_hosts():
    port = free_port()
    outputs = _run_jobs([_on_host(h, torchrun_command(__file__, "collectives", nnodes=2, node_rank=h,
                                                      nproc=CARDS_PER_HOST, port=port))
                         for h in range(2)])
    passed = [json.loads(line[len(_PASSED):]) for out in outputs for line in out.splitlines()
              if line.startswith(_PASSED)]
    assert passed == [[check.__name__ for check in _CHECKS]] * 4  # every rank ran every check


def test_zero3_on_two_hosts_matches_one_host(one_host_losses):
    port = free_port()
    two_hosts = _losses(_run_jobs([_on_host(h, torchrun_command(EXAMPLE, *TRAIN_ARGS, nnodes=2, node_rank=h,
                                                                   nproc=CARDS_PER_HOST, port=port))
                                   for h in range(2)]))
    assert len(two_hosts) == len(one_host_losses)
    assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(two_hosts, one_host_losses)), \
        (two_hosts, one_host_losses)


def test_deepspeed_launcher_with_a_hostfile_and_no_ssh(one_host_losses, tmp_path):
    """`deepspeed --hostfile` over the two hosts: with --no_ssh each host runs the launcher with its
    --node_rank, DeepSpeed's multi-node path where no launcher program or ssh is at hand."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots={CARDS_PER_HOST}\n" for host in HOSTS))
    port = free_port()
    commands = [_on_host(h, [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--no_ssh",
                             "--node_rank", h, "--master_addr", "127.0.0.1", "--master_port", port, EXAMPLE,
                             *TRAIN_ARGS]) for h in range(2)]
    losses = _losses(_run_jobs(commands))
    assert len(losses) == len(one_host_losses)
    assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(losses, one_host_losses)), \
        (losses, one_host_losses)


if __name__ == "__main__":
    _collectives_worker()
    os._exit(0)
