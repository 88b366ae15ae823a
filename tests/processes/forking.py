"""The fork servers of this process (fork_server.py): one for each environment whose torch-first
commands are asked for a second time, so that those commands pay 0.2-0.5 s instead of an
interpreter's start and `import torch` (1.5-3 s on 2 cores)."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from processes.jobs import ROOT

SCRIPT = pathlib.Path(__file__).with_name("fork_server.py")


class ForkServer:
    """A fork_server.py process for one environment, and its clients still running (as far as
    idle() last looked)."""

    def __init__(self, env: dict):
        self.directory = tempfile.mkdtemp(prefix="supa_emu-fork-server-")
        self.address = os.path.join(self.directory, "socket")
        self.clients: list[subprocess.Popen] = []
        # Bound here, before the server starts: a client started next finds it (and waits in its backlog).
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(self.address)
            listener.listen(64)
            serve = [sys.executable, SCRIPT, "serve", str(listener.fileno()), str(os.getpid())]
            self.proc = subprocess.Popen(serve, cwd=ROOT,
                                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, pass_fds=[listener.fileno()],
                                         start_new_session=True)  # ended by close(), at exit at the latest

    def client_command(self, command: list) -> list:
        return client_command(self.address, command)

    def idle(self) -> bool:
        self.clients = [client for client in self.clients if client.poll() is None]
        return not self.clients

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it died already (its clients ran their commands themselves)
            pass
        self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def client_command(address: str, command: list) -> list:
    """What starts `command` (`python ...`) forked by the fork server at `address`, or as itself
    where none answers there."""
    # -I -S: the client needs the standard library only, and starts in a few milliseconds.
    return [sys.executable, "-I", "-S", SCRIPT, "run", address, json.dumps(command[1:])]


class ForkServers:
    """This process's fork servers: one for each environment that forked commands ask for a second
    time (a server for a command asked for once would cost what that command's own start does), at
    most LIMIT at a time (each holds an interpreter with torch imported); the least recently used
    idle one makes room."""

    LIMIT = 2
    # Not part of what a child imports torch with: pytest's name of the test, and what torch itself sets
    # in this process once it compiled or profiled, and reads only then, after import (a child still
    # gets them: the client passes its whole environment). With them in the key, one in-process compile
    # would start a second server for the same environment.
    _VOLATILE = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "DISABLE_CUPTI_LAZY_REINIT",
                 "TEARDOWN_CUPTI")

    def __init__(self):
        self.asked: dict[tuple, int] = {}
        self.servers: dict[tuple, ForkServer] = {}  # least recently used first

    def server_for(self, command: list, env: dict) -> ForkServer | None:
        if len(command) < 2 or command[0] != sys.executable or command[1].startswith("-"):
            return None  # interpreter options, -m or -c: not a script that can be run in a forked child
        key = tuple(sorted((k, v) for k, v in env.items() if k not in self._VOLATILE))
        self.asked[key] = self.asked.get(key, 0) + 1
        server = self.servers.pop(key, None)
        if server is not None and server.proc.poll() is not None:  # it died: another takes its place
            server.close()
            server = None
        if server is None and self.asked[key] >= 2 and self._make_room():
            server = ForkServer(dict(key))
        if server is not None:
            self.servers[key] = server
        return server

    def _make_room(self) -> bool:
        if len(self.servers) < self.LIMIT:
            return True
        for key, server in self.servers.items():
            if server.idle():
                server.close()
                del self.servers[key]
                return True
        return False

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


SERVERS = ForkServers()
atexit.register(lambda: SERVERS.close())  # the servers of the moment (a test may swap SERVERS)
