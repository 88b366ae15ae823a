"""Launcher commands (torchrun, deepspeed) and the rendezvous port they are given: `PORT` in a command
becomes a loopback port that was free a moment ago."""

from __future__ import annotations

import shutil
import socket
import sys


class _FreePort:
    """Stands for a free loopback port in a command until the command starts (`with_free_port`)."""

    def __repr__(self) -> str:
        return "PORT"

    def __str__(self) -> str:  # in a string it could not be replaced: said at once, not as a failed rendezvous
        raise TypeError("harness.PORT stands for a port as an element of a command list of its own, "
                        "not inside a string")


PORT = _FreePort()


def free_port() -> int:
    """A loopback port that was free a moment ago (for a rendezvous the test starts next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_free_port(command: list) -> list:
    """`command` with each PORT replaced by one free port."""
    port = free_port() if any(part is PORT for part in command) else None
    return [port if part is PORT else part for part in command]


def lost_its_port(command: list, output: str) -> bool:
    """Whether a job of `command` (as given, with PORT) failed because another process took its port
    between the moment it was picked and the rendezvous binding it."""
    return any(part is PORT for part in command) and "address already in use" in output.lower()


def torchrun_command(script, *args, nproc: int, port, nnodes: int = 1, node_rank: int = 0) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--node-rank", node_rank,
            "--nproc-per-node", nproc, "--master-addr", "127.0.0.1", "--master-port", port, script, *args]


def deepspeed_command(script, *args, num_gpus: int, port, launcher_args=()) -> list:
    runner = shutil.which("deepspeed")
    prefix = [runner] if runner else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [*prefix, "--num_gpus", num_gpus, "--master_port", port, *launcher_args, script, *args]
