"""The process harness itself (harness.py): its three ways run what they say where they say, hung jobs die
with what they started, output and environment reach the test as asked, launches retry only a lost
rendezvous port, and nothing outlives the test run."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import harness
import ranks
from harness import Finished
from processes import forking, jobs


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone_soon(pid: int, timeout: float = 10) -> bool:
    """Whether `pid` is gone within a few seconds (a SIGKILL lands at once; the exit may lag on a busy machine)."""
    deadline = time.monotonic() + timeout
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


# ---- the three ways: in the test process, in a fresh process, in N ranks --------------------------
def test_run_as_main_runs_a_script_in_the_test_process_with_its_arguments(tmp_path):
    script, out = tmp_path / "script.py", tmp_path / "out.json"
    script.write_text("import json, os, sys\n"
                      "json.dump({'name': __name__, 'argv': sys.argv, 'pid': os.getpid()}, open(sys.argv[1], 'w'))\n")
    argv = list(sys.argv)
    harness.run_as_main([script, out, "--flag"])
    assert json.loads(out.read_text()) == {"name": "__main__", "argv": [str(script), str(out), "--flag"],
                                           "pid": os.getpid()}
    assert sys.argv == argv  # put back


def test_a_fresh_process_sees_its_environment_and_the_test_process_does_not():
    result = harness.fresh_process(_where_and_what, 1, env={"HARNESS_TEST_SET": "there"})
    assert (result.value["variable"], result.value["sum"]) == ("there", 2) and result.value["pid"] != os.getpid()
    assert "HARNESS_TEST_SET" not in os.environ
    code = harness.fresh_process("import os, sys; print(os.environ['HARNESS_TEST_SET'], sys.argv[1:])", "a", "b",
                                 env={"HARNESS_TEST_SET": "code"})
    assert code.stdout == "code ['a', 'b']\n"
    command = harness.fresh_process([sys.executable, "-c", "import sys; print(sys.argv[1:])", harness.PORT], "x")
    port, extra = eval(command.stdout)
    assert 0 < int(port) < 65536 and extra == "x"


def _says_its_rank(rank, world, folder):
    import torch
    import torch.distributed as dist

    facts = {"rank": dist.get_rank(), "world": dist.get_world_size(), "card": torch.accelerator.current_device_index(),
             "pid": os.getpid()}
    (folder / f"rank{rank}.json").write_text(json.dumps(facts))


def test_n_ranks_each_run_the_body_with_their_rank(tmp_path):
    try:
        ranks.distributed_test(world=3)(_says_its_rank)(folder=tmp_path)
    finally:
        ranks.close_rank_pools()  # no other test of this file runs in three ranks
    facts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert [(fact["rank"], fact["world"], fact["card"]) for fact in facts] == [(0, 3, 0), (1, 3, 1), (2, 3, 2)]
    assert len({fact["pid"] for fact in facts} | {os.getpid()}) == 4


@pytest.mark.slow  # waits out a time limit
def test_a_hung_job_fails_the_test_and_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    # The job starts a grandchild of its own, says its pid, then never finishes.
    job = ["sh", "-c", f'sleep 600 & echo $! > {pid_file}; wait']
    with pytest.raises(AssertionError, match=r"job hung \(still running after 3 s\): sh -c"):
        harness.fresh_process(job, timeout=3)
    grandchild = int(pid_file.read_text())
    assert _gone_soon(grandchild), f"the job's grandchild {grandchild} outlived the killed job"
    assert not jobs.LIVE_GROUPS


def test_jobs_waited_for_together_name_themselves_when_one_hangs(tmp_path):
    quick = harness.fresh_process([sys.executable, "-c", "print('done')"], wait=False)
    stuck = harness.fresh_process(["sleep", "600"], wait=False)
    with pytest.raises(AssertionError, match="the pair hung .*sleep 600"):
        harness.wait([quick, stuck], timeout=1, what="the pair")
    assert _gone_soon(stuck.pid)


def test_output_and_return_code_are_captured():
    code = "import sys; print('to out'); print('to err', file=sys.stderr); sys.exit(3)"
    result = harness.fresh_process([sys.executable, "-c", code], check=False)
    assert (result.returncode, result.stdout, result.stderr) == (3, "to out\n", "to err\n")
    assert result.output == "to out\nto err\n"
    with pytest.raises(AssertionError, match=r"(?s)exited with 3:\nstdout:\nto out\n\nstderr:\nto err"):
        result.require_success()
    with pytest.raises(AssertionError, match="exited with 3"):
        harness.fresh_process("import sys; sys.exit(3)")


def _the_test_variables() -> dict:
    return {name: os.environ.get(name) for name in ("HARNESS_TEST_DROPPED", "HARNESS_TEST_KEPT", "HARNESS_TEST_SET")}


def test_environment_values_are_set_and_none_unsets(monkeypatch):
    monkeypatch.setenv("HARNESS_TEST_DROPPED", "inherited")
    monkeypatch.setenv("HARNESS_TEST_KEPT", "inherited")
    report = harness.fresh_process(_the_test_variables, env={"HARNESS_TEST_DROPPED": None, "HARNESS_TEST_SET": 7}).value
    assert report == {"HARNESS_TEST_DROPPED": None, "HARNESS_TEST_KEPT": "inherited", "HARNESS_TEST_SET": "7"}


def test_checkout_first_puts_the_checkout_ahead_of_the_inherited_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert harness.child_env()["PYTHONPATH"] == "/elsewhere"
    assert harness.child_env(checkout_first=True)["PYTHONPATH"] == os.pathsep.join([str(harness.ROOT), "/elsewhere"])
    monkeypatch.delenv("PYTHONPATH")
    assert harness.child_env(checkout_first=True)["PYTHONPATH"] == str(harness.ROOT)


def test_json_lines_reads_prefixed_lines_or_object_lines():
    stdout = "\n".join(["noise", '{"event": "step", "loss": 1.5}', "RESULT [1, 2]", 'text {"not": "first"}',
                        '{"event": "summary"}', "RESULT null", ""])
    finished = Finished(["job"], 0, stdout, "")
    assert finished.json_lines() == [{"event": "step", "loss": 1.5}, {"event": "summary"}]
    assert finished.json_lines("RESULT ") == [[1, 2], None]
    assert Finished(["job"], 0, "RESULT {broken", "").json_lines() == []
    with pytest.raises(json.JSONDecodeError):
        Finished(["job"], 0, "RESULT {broken", "").json_lines("RESULT ")


def test_a_command_that_lost_its_port_runs_once_more_on_another(tmp_path):
    log = tmp_path / "ports"

    def ports_tried(message: str) -> list:
        log.unlink(missing_ok=True)
        code = f"import sys; open({str(log)!r}, 'a').write(sys.argv[1] + chr(10)); sys.exit({message!r})"
        result = harness.fresh_process([sys.executable, "-c", code, harness.PORT], check=False, timeout=60)
        assert result.returncode == 1
        return log.read_text().split()

    retried = ports_tried("RuntimeError: Address already in use")
    assert len(retried) == 2 and all(port.isdigit() for port in retried)
    assert len(ports_tried("some other failure")) == 1
    with pytest.raises(TypeError, match="as an element of a command list"):
        f"--master-port={harness.PORT}"


def _start_a_job_and_leave() -> int:
    return harness.fresh_process(["sleep", "600"], wait=False).pid


def test_jobs_a_test_run_left_behind_are_killed_when_it_exits():
    # A run that starts a job and exits without waiting for it.
    assert _gone_soon(harness.fresh_process(_start_a_job_and_leave).value), "a job outlived the run that started it"


# ------------------------------------------------------------------------------------------------
# Functions in fresh interpreters
# ------------------------------------------------------------------------------------------------
def _where_and_what(offset):
    return {"pid": os.getpid(), "variable": os.environ.get("HARNESS_TEST_SET"), "sum": offset + 1}


def _raises():
    raise ValueError("the function disagrees")


def test_a_function_runs_in_a_fresh_interpreter_and_returns_its_value():
    result = harness.fresh_process(_where_and_what, 41, env={"HARNESS_TEST_SET": "yes"})
    assert result.value["pid"] != os.getpid() and "HARNESS_TEST_SET" not in os.environ
    assert (result.value["variable"], result.value["sum"]) == ("yes", 42)
    assert "FUNCTION-RETURNED" not in result.stdout


def test_a_function_that_raises_fails_with_its_traceback():
    result = harness.fresh_process(_raises, check=False)
    assert result.returncode == 1 and result.value is None
    with pytest.raises(AssertionError, match=r"(?s)in _raises.*ValueError: the function disagrees"):
        result.require_success()


_FIRST = harness.fresh_process(_where_and_what, 1, env={"HARNESS_TEST_SET": "shared"}, shared=harness.ANY)
_RAISES = harness.fresh_process(_raises, env={"HARNESS_TEST_SET": "shared"}, shared=harness.ANY)
_SECOND = harness.fresh_process(_where_and_what, 2, env={"HARNESS_TEST_SET": "shared"}, shared=harness.ANY)


def test_shared_functions_of_one_environment_run_in_one_interpreter_and_fail_alone():
    first, second = _FIRST.result().value, _SECOND.result().value
    assert first["pid"] == second["pid"] != os.getpid()
    assert (first["sum"], second["sum"], second["variable"]) == (2, 3, "shared")
    with pytest.raises(AssertionError, match="ValueError: the function disagrees"):
        _RAISES.result()


# ---- several scripts in one process (script_sequence.py) -----------------------------------------

def test_scripts_in_sequence_start_as_in_a_fresh_process_and_split_by_script(tmp_path):
    import script_sequence

    first = tmp_path / "first.py"
    first.write_text("import sys, torch\n"
                     "keep = torch.empty(1 << 20, device='supa')\n"  # left allocated after the script
                     "print('first', sys.argv[1:])\n")
    second = tmp_path / "second.py"
    second.write_text("import torch\n"
                      "print('second sees peak', torch.supa.max_memory_allocated(0) - torch.supa.memory_allocated(0))\n"
                      "raise SystemExit(3)\n")
    scripts = [["one", str(first), "--x", "1"], ["two", str(second)], ["three", str(first)]]
    job = harness.fresh_process([sys.executable, script_sequence.__file__, json.dumps(scripts)], timeout=120,
                                check=False)
    assert job.returncode == 3, job.describe()
    parts = script_sequence.outputs(job, ["one", "two", "three"])
    assert (parts["one"].returncode, parts["one"].stdout) == (0, "first ['--x', '1']\n")
    # The peak statistics start again at what is allocated; the failing script fails alone.
    assert (parts["two"].returncode, parts["two"].stdout) == (3, "second sees peak 0\n")
    assert (parts["three"].returncode, parts["three"].stdout) == (None, "")


# ---- forked interpreters (processes/fork_server.py) ---------------------------------------------------
def _interpreter_facts(marker: str) -> dict:
    import random

    import torch

    print(f"stdout of {marker}")
    print(f"stderr of {marker}", file=sys.stderr)
    return {"pid": os.getpid(), "cwd": os.getcwd(), "argv0": sys.argv[0], "path0": sys.path[0],
            "marker": os.environ.get("HARNESS_FORK_MARKER"), "test": os.environ.get("PYTEST_CURRENT_TEST"),
            "session_leader": os.getsid(0) == os.getpid(), "random": random.random(),
            "card": str(torch.ones(1, device=torch.accelerator.current_accelerator()).device)}


def _exits_with(how: str) -> None:
    import signal

    if how == "raise":
        raise RuntimeError("raised in the child")
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def _servers():
    """Fork servers of these tests' own (shared by them), ended after the last."""
    servers, kept = forking.ForkServers(), forking.SERVERS
    forking.SERVERS = servers
    yield servers
    forking.SERVERS = kept
    servers.close()


# SUPA_EMU_MEMORY beyond the host makes activation warn at `import torch`: each interpreter,
# forked or not, must show that warning in its own stderr, as a fresh one does.
_FORKED_ENV = {"SUPA_EMULATE": "1", "SUPA_EMU_MEMORY": "99999TiB", "HARNESS_FORK_MARKER": "m"}


@pytest.mark.emulation_only
def test_forked_interpreters_are_as_fresh_ones_of_their_environment(_servers, tmp_path):
    results = [harness.fresh_process(_interpreter_facts, f"call {n}", env=_FORKED_ENV, cwd=tmp_path)
               for n in range(3)]
    assert len(_servers.servers) == 1  # the first ran fresh; the second started the server
    facts = [result.value for result in results]
    assert len({fact["pid"] for fact in facts}) == 3
    for n, (result, fact) in enumerate(zip(results, facts)):
        assert result.stdout == f"stdout of call {n}\n"
        assert "RuntimeWarning: SUPA_EMU_MEMORY='99999TiB'" in result.stderr
        assert result.stderr.endswith(f"stderr of call {n}\n")
        assert fact["cwd"] == str(tmp_path) and fact["argv0"] == str(harness.ROOT / "tests" / "harness.py")
        assert fact["path0"] == str(harness.ROOT / "tests") and fact["marker"] == "m"
        assert fact["test"] == os.environ["PYTEST_CURRENT_TEST"] and fact["session_leader"]
        assert fact["card"] == "supa:0"
    assert facts[1]["random"] != facts[2]["random"]  # each child seeds its own


@pytest.mark.emulation_only
@pytest.mark.parametrize("how, code, says", [("raise", 1, "RuntimeError: raised in the child"), ("exit", 3, ""),
                                             ("signal", -15, "")])
def test_a_forked_interpreter_exits_as_a_fresh_one(_servers, how, code, says):
    results = [harness.fresh_process(_exits_with, how, env=_FORKED_ENV, check=False) for _ in range(2)]
    assert _servers.servers, "the second was not forked"
    for result in results:
        assert result.returncode == code and says in result.stderr


@pytest.mark.emulation_only
def test_a_client_that_dies_while_asking_leaves_the_server_serving(_servers):
    import socket

    for _ in range(2):
        harness.fresh_process(_exits_with, "exit", env=_FORKED_ENV, check=False)
    server = list(_servers.servers.values())[-1]
    for message in (b"", b"\x00"):  # gone before a word, and in the middle of one
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(server.address)
            client.sendall(message)
    assert harness.fresh_process(_exits_with, "exit", env=_FORKED_ENV, check=False).returncode == 3
    assert server.proc.poll() is None and list(_servers.servers.values())[-1] is server


def _sleeps() -> None:
    time.sleep(600)


def _children(pid: int) -> list[int]:
    return [int(child) for child in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow  # waits out a time limit
@pytest.mark.emulation_only
def test_a_hung_forked_interpreter_is_killed_and_a_dead_server_is_replaced(_servers):
    for _ in range(2):
        harness.fresh_process(_interpreter_facts, "warm-up")
    server = list(_servers.servers.values())[-1]  # the one the warm-up used (most recently used last)
    hung = harness.fresh_process(_sleeps, wait=False)
    deadline = time.monotonic() + 30
    while not _children(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    [child] = _children(server.proc.pid)
    with pytest.raises(AssertionError, match="hung"):
        harness.wait([hung], timeout=2)
    assert _gone_soon(child), "the hung child outlived its client"
    server.proc.kill()
    server.proc.wait()
    assert harness.fresh_process(_interpreter_facts, "after the server died").value["card"] == "supa:0"
    assert server not in _servers.servers.values()  # a dead server is replaced


def test_a_server_whose_test_process_was_killed_ends_and_removes_its_socket():
    # The test process starts a server and is killed (no atexit, as when pytest gets SIGTERM).
    started = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, sys
        sys.path.insert(0, "tests")
        from processes import forking
        server = forking.ForkServer(dict(os.environ))
        print(server.proc.pid, server.address, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)], cwd=harness.ROOT, capture_output=True, text=True, timeout=60)
    assert started.returncode == -signal.SIGKILL, started.stderr
    pid, address = started.stdout.split()
    # It notices once torch is imported (seconds) and within a second of its next look.
    assert _gone_soon(int(pid), timeout=60), "the fork server outlived the process that started it"
    assert not os.path.exists(os.path.dirname(address))


def test_a_client_that_finds_no_server_runs_the_command_itself(tmp_path):
    result = harness.fresh_process(forking.client_command(str(tmp_path / "no-server-here"),
                                                          [sys.executable, "-c", "print('ran')"]))
    assert (result.returncode, result.stdout) == (0, "ran\n")


def test_test_files_stay_short_enough_to_read_as_one_subject():
    lengths = {path.name: len(path.read_text().splitlines()) for path in (harness.ROOT / "tests").glob("test_*.py")}
    assert {name: n for name, n in lengths.items() if n > 600} == {}
    assert len((harness.ROOT / "tests" / "harness.py").read_text().splitlines()) < 300
