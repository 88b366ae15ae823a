"""Test interpreters forked from one that has imported torch already (`torch_first`, harness.fresh_process).

Most of a test interpreter's start-up is `import torch` (1.2-1.5 s of CPU here, the emulator's
activation included), and the suite starts several hundred: ranks of `ranks.distributed_test`,
functions run by `harness.fresh_process`. A fork server imports torch once for an environment and
forks a child for each such command; the child is what a fresh interpreter of that environment is
once it has imported torch, and it runs the command's script as `__main__`.

What makes a child the same as a fresh interpreter:
- the server's environment is the command's (forking.py starts one server per environment), so the
  activation it ran is the one the command's own `import torch` would have run;
- what that import printed (activation's warnings) is captured by the server and written again
  to each child's stdout and stderr before its script starts, as a fresh interpreter prints it;
- the child gets the command's stdin, stdout and stderr (passed over the socket), its working
  directory, environment, sys.argv, sys.path[0], a process group and session of its own, a new
  seed for `random`, and exits as a fresh interpreter does (atexit, an uncaught exception's
  traceback and exit code 1);
- what differs: torch and what it imports are in sys.modules before the script runs. So only
  callers whose command begins with `import torch` ask for it (ranks and test functions, not code
  that a test writes out to check the order of imports), and a function that sets the environment
  before it imports torch, or a check that compares what two interpreters' own starts make, asks
  for fresh ones (`fresh_process(..., torch_first=False)`): pickle names some torch objects after the
  first module in sys.modules that holds them, so the order of sys.modules shows in Inductor's
  cache keys.

A command reaches its server through a small client (`run`), started in the command's place: it
stays the process the harness waits for and kills, and reports the child's exit code as its own.
When the client ends early (killed after a hang), the server kills the child's process group. A
client that finds no server runs the command itself (exec), so a dead server costs time, not tests.
A server ends, removing its socket, once the test process that started it has ended without closing
it (killed: its atexit never ran), instead of staying under init with torch imported.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys

_HEADER = struct.Struct("!I")
_FORKED, _EXITED = "forked", "exited"
_PARENT_CHECK_S = 1.0  # how often an idle server checks that the process that started it is alive


# ---- the server ---------------------------------------------------------------------------------
def serve(listening_fd: int, parent: int) -> None:
    """Serves on the listening socket `listening_fd` (the harness binds it before it starts the
    server, so that clients may connect at once: they wait in its backlog until torch is imported)
    for as long as process `parent`, which started it, lives."""
    listener = socket.socket(fileno=listening_fd)
    import_output = _import_torch()
    gc.collect()
    gc.freeze()  # what the import built stays shared with the children: their collections skip it
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_read, False)
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    selector.register(wakeup_read, selectors.EVENT_READ, None)
    children: dict[int, socket.socket] = {}
    while True:
        events = selector.select(timeout=_PARENT_CHECK_S)
        if os.getppid() != parent:
            # The test process that started it ended without closing it (killed: no atexit); a
            # server that stayed would keep torch's memory under init for good. Its children run on.
            _remove_socket(listener)
            return
        for key, _ in events:
            if key.fileobj is listener:
                client, _ = listener.accept()
                # A client that died while asking, or a fork that failed: no child. A client still
                # there reads no "forked" line and runs its command itself (see `run`).
                try:
                    request, fds = _receive(client)
                except (OSError, ValueError, struct.error):
                    client.close()
                    continue
                try:
                    pid = os.fork()
                except OSError:
                    _close_all(fds)
                    client.close()
                    continue
                if pid == 0:
                    selector.close()
                    for fd in (wakeup_read, wakeup_write):
                        os.close(fd)
                    for sock in (listener, client, *children.values()):
                        sock.close()
                    _become(request, fds, import_output)
                    return  # the child ran the command and exits as its interpreter
                _close_all(fds)
                children[pid] = client
                selector.register(client, selectors.EVENT_READ, pid)
                _send_line(client, f"{_FORKED} {pid}")
            elif key.fileobj == wakeup_read:
                while os.read(wakeup_read, 512) == 512:
                    pass
                _reap(children, selector)
            else:  # a client that ended before its child: it was killed, so the child is killed too
                pid = key.data
                selector.unregister(key.fileobj)
                if pid in children:
                    _kill_group(pid)


def _remove_socket(listener: socket.socket) -> None:
    """Removes the listening socket's file and its directory (ForkServer's, left by its process)."""
    address = listener.getsockname()
    try:
        os.unlink(address)
        os.rmdir(os.path.dirname(address))
    except OSError:
        pass


def _import_torch() -> tuple[bytes, bytes]:
    """Imports torch as the command would, with what it writes to stdout and stderr captured."""
    import tempfile

    captured = []
    saved = [os.dup(1), os.dup(2)]
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    try:
        for fd, file in zip((1, 2), files):
            os.dup2(file.fileno(), fd)
        import torch  # noqa: F401  (activates the emulator as the command's own import would; nothing more)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        for file in files:
            file.seek(0)
            captured.append(file.read())
            file.close()
    return captured[0], captured[1]


def _receive(client: socket.socket):
    """The command a client sent, and its stdin, stdout and stderr (closed here if the rest fails:
    held by the server, a dead client's pipes would never reach end-of-file for the harness)."""
    data, fds, _, _ = socket.recv_fds(client, 1 << 16, 3)
    try:
        if len(fds) != 3:
            raise ConnectionError("the client sent no stdin, stdout and stderr")
        (size,) = _HEADER.unpack_from(data)
        payload = bytearray(data[_HEADER.size:])
        while len(payload) < size:
            chunk = client.recv(size - len(payload))
            if not chunk:
                raise ConnectionError("the client ended while sending its command")
            payload += chunk
        return json.loads(payload), fds
    except BaseException:
        _close_all(fds)
        raise


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


def _reap(children: dict, selector) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        client = children.pop(pid, None)
        if client is not None:
            if client in selector.get_map():  # not when its end was seen first (see serve)
                selector.unregister(client)
            _send_line(client, f"{_EXITED} {os.waitstatus_to_exitcode(status)}")
            client.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _send_line(client: socket.socket, line: str) -> None:
    try:
        client.sendall((line + "\n").encode())
    except OSError:  # the client is gone (killed): nobody is left to tell
        pass


# ---- the child ------------------------------------------------------------------------------------
def _become(request: dict, fds: list, import_output: tuple) -> None:
    """Turns the forked child into the command's interpreter and runs the command."""
    import random
    import runpy

    os.setsid()  # a session of its own, as jobs.start gives a fresh interpreter
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    for stream, text in zip((sys.stdout, sys.stderr), import_output):
        stream.flush()
        os.write(stream.fileno(), text)
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")


# ---- the client ---------------------------------------------------------------------------------
def run(address: str, argv_json: str) -> None:
    """Has the server at `address` fork the command `argv` (the interpreter's arguments) with this
    process's stdin, stdout, stderr, working directory and environment; exits as the child did."""
    argv = json.loads(argv_json)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.connect(address)
        payload = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        message = _HEADER.pack(len(payload)) + payload
        socket.send_fds(client, [message[:1 << 15]], [0, 1, 2])
        client.sendall(message[1 << 15:])
        replies = client.makefile("r")
        forked = replies.readline()
    except OSError:
        forked = ""
    if not forked.startswith(_FORKED):  # no server (it never came up, or it died): run it here
        os.execv(sys.executable, [sys.executable, *argv])
    exited = replies.readline()
    if not exited.startswith(_EXITED):
        sys.stderr.write("fork_server: the server ended while the command ran; its exit code is unknown\n")
        sys.exit(1)
    code = int(exited.split()[1])
    if code < 0:  # killed by a signal: end the same way, so that the harness sees what it would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
