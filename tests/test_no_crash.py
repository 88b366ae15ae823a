"""No public entry point of `torch.accelerator` or `torch.cuda` (supa under transfer_to_supa) ends the
process, whatever it is called with: a wrong argument raises a Python exception, as on a card.

The entry points are enumerated from the modules (public callables defined by torch or the
emulator); each is called with no arguments, with each of GENERIC_ARGS (wrong types, device
indices out of range, negative values, None) and with its valid arguments from VALID_ARGS. The
calls run in a child interpreter, one after the other, each bounded by CALL_TIMEOUT_S; a call that
kills the child is reported, and a new child carries on after it, so one run finds every crash.
SKIPPED names the calls that may block or exit (with why).
"""

import faulthandler
import inspect
import os
import signal

import pytest
import torch

import harness

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")

CALL_TIMEOUT_S = 10

# One of each kind of argument a caller gets wrong, besides calling with none.
GENERIC_ARGS = [
    (None,), (0,), (1,), (-1,), (1 << 20,), (-(1 << 40),), (1 << 70,), (1.5,), (True,), ("supa:0",), ("cuda:99",),
    ("not a device",), (object(),), ([0],), (0, 0), (None, None, None),
]


def _stream():
    return torch.cuda.Stream()


def _recorded_event(**flags):
    event = torch.cuda.Event(**flags)
    event.record()
    return event


# The valid calls that need arguments the generic ones do not give: each makes (args, kwargs) in
# the child, right before its call.
VALID_ARGS = {
    "torch.accelerator.set_stream": [lambda: ((_stream(),), {})],
    "torch.accelerator.device_index": [lambda: ((0,), {})],
    "torch.cuda.set_stream": [lambda: ((_stream(),), {})],
    "torch.cuda.stream": [lambda: ((_stream(),), {})],
    "torch.cuda.StreamContext": [lambda: ((_stream(),), {})],
    "torch.cuda.Stream": [
        lambda: ((), {"priority": -1}),
        lambda: ((), {"stream_id": _stream().stream_id, "device_index": 0, "device_type": 1}),
        lambda: ((), {"stream_id": 2, "device_index": 1 << 20, "device_type": 1}),
        lambda: ((), {"stream_id": -1, "device_index": -5, "device_type": -3}),
        lambda: ((), {"stream_ptr": 0, "priority": -1}),
    ],
    "torch.cuda.ExternalStream": [lambda: ((_stream().cuda_stream,), {})],
    "torch.cuda.Event": [lambda: ((), {"enable_timing": True, "blocking": True, "interprocess": True,
                                       "external": True})],
    "torch.cuda.get_stream_from_external": [lambda: ((_stream().cuda_stream, 0), {})],
    "torch.cuda.can_device_access_peer": [lambda: ((0, 1), {}), lambda: ((0, 1 << 20), {})],
    "torch.cuda.check_error": [lambda: ((2,), {})],
    "torch.cuda.caching_allocator_alloc": [lambda: ((1024, 0, _stream()), {}), lambda: ((1024, 0, 1 << 20), {})],
    "torch.cuda.caching_allocator_delete": [lambda: ((torch.cuda.caching_allocator_alloc(1024),), {})],
    "torch.cuda.device_of": [lambda: ((torch.ones(2, device="cuda"),), {})],
    "torch.cuda.set_rng_state": [lambda: ((torch.cuda.get_rng_state(),), {}),
                                 lambda: ((torch.zeros(3, dtype=torch.uint8),), {})],
    "torch.cuda.set_rng_state_all": [lambda: ((torch.cuda.get_rng_state_all(),), {})],
    "torch.cuda.set_per_process_memory_fraction": [lambda: ((1.0, 0), {}), lambda: ((2.0,), {})],
    "torch.cuda.use_mem_pool": [lambda: ((torch.cuda.MemPool(),), {})],
    "torch.cuda.graph": [lambda: ((torch.cuda.CUDAGraph(),), {})],
    "torch.cuda.set_sync_debug_mode": [lambda: (("warn",), {}), lambda: ((0,), {})],
    "torch.cuda.set_autocast_dtype": [lambda: ((torch.bfloat16,), {})],
    "torch.cuda.memory_usage": [lambda: ((0,), {})],
    "torch.cuda.Stream.wait_event": [lambda: ((_stream(), _recorded_event()), {})],
    "torch.cuda.Event.elapsed_time": [
        lambda: ((_recorded_event(enable_timing=True), _recorded_event(enable_timing=True)), {}),
        lambda: ((torch.cuda.Event(), torch.cuda.Event()), {}),
    ],
}

# Calls that legitimately block or end the process, each with the reason: none so far.
SKIPPED = {}

def _entry_points():
    """(qualified name, callable) of every public entry point of the two modules, in a fixed order."""
    found = []
    for prefix, module in (("torch.accelerator", torch.accelerator), ("torch.cuda", torch.cuda)):
        for name in sorted(dir(module)):
            value = getattr(module, name)
            if name.startswith("_") or not callable(value) or inspect.ismodule(value):
                continue
            # Names a module imported for itself (typing.Any, functools.lru_cache) are not its entry points.
            if not getattr(value, "__module__", "").startswith(("torch", "supa_emu")):
                continue
            found.append((f"{prefix}.{name}", value))
    # The methods that run the stream and event model, on objects the calls make.
    found += [("torch.cuda.Stream.wait_event", lambda stream, event: stream.wait_event(event)),
              ("torch.cuda.Event.elapsed_time", lambda start, end: start.elapsed_time(end))]
    return found


def _calls():
    """(qualified name, callable, make (args, kwargs)) of every call, in a fixed order."""
    return [(qualname, fn, make) for qualname, fn in _entry_points()
            for make in [lambda args=args: (args, {}) for args in [(), *GENERIC_ARGS]] + VALID_ARGS.get(qualname, [])]


def _describe(qualname: str, args, kwargs) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{qualname}({', '.join(shown)})"


_STARTED, _FINISHED = "CALL-STARTED ", "CALL-FINISHED "


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # unbuffered: a crash right after must not lose it


def call_entries(first: int) -> None:
    """The child: runs the calls from number `first` on, reporting each one's start and outcome."""
    calls = _calls()
    for number in range(first, len(calls)):
        qualname, fn, make = calls[number]
        try:
            args, kwargs = make()
        except Exception as exc:  # noqa: BLE001 - VALID_ARGS is stale: the test reports it
            _say(f"{_STARTED}{number} {qualname}")
            _say(f"{_FINISHED}{number} unmade {type(exc).__name__}: {exc}")
            continue
        description = _describe(qualname, args, kwargs)
        _say(f"{_STARTED}{number} {description}")
        if description in SKIPPED:
            _say(f"{_FINISHED}{number} skipped")
            continue
        faulthandler.dump_traceback_later(CALL_TIMEOUT_S, exit=True)  # in C: bounds a call that holds the GIL too
        try:
            fn(*args, **kwargs)
            outcome = "returned"
        except BaseException as exc:  # noqa: BLE001 - SystemExit included: only a signal may end the child
            outcome = f"raised {type(exc).__name__}"
        finally:
            faulthandler.cancel_dump_traceback_later()
        _say(f"{_FINISHED}{number} {outcome}")


def _run_all() -> tuple[dict, dict, dict]:
    """Runs every call in children: (outcome per call, signal name per crashed call, hung calls), each
    call named by its number and description (two calls may read the same)."""
    outcomes, crashed, hung = {}, {}, {}
    first = 0
    while True:
        run = harness.fresh_process(call_entries, first, check=False, timeout=600)
        started, finished = {}, set()
        for line in run.stdout.splitlines():
            if line.startswith(_STARTED):
                number, description = line[len(_STARTED):].split(" ", 1)
                started[int(number)] = description
            elif line.startswith(_FINISHED):
                number, outcome = line[len(_FINISHED):].split(" ", 1)
                finished.add(int(number))
                outcomes[int(number), started[int(number)]] = outcome
        if run.returncode == 0:
            return outcomes, crashed, hung
        last = max(started, default=None)
        if last is None or last in finished:
            raise AssertionError("the child ended between calls:\n" + run.describe())
        if run.returncode < 0:
            crashed[last, started[last]] = signal.Signals(-run.returncode).name
        elif "Timeout (" in run.stderr:
            hung[last, started[last]] = f"no answer within {CALL_TIMEOUT_S} s"
        else:
            raise AssertionError(f"the child exited during {started[last]}:\n" + run.describe())
        first = last + 1


@pytest.mark.emulation_only
def test_no_entry_point_ends_the_process_by_a_signal():
    outcomes, crashed, hung = _run_all()
    assert len(outcomes) + len(crashed) + len(hung) > 20 * len(GENERIC_ARGS)
    assert any(outcome == "returned" for outcome in outcomes.values())
    assert any(outcome.startswith("raised") for outcome in outcomes.values())
    unmade = {call: outcome for call, outcome in outcomes.items() if outcome.startswith("unmade")}
    assert not unmade, f"VALID_ARGS could not make these arguments: {unmade}"
    assert not hung, f"calls that did not return within {CALL_TIMEOUT_S} s: {hung}"
    ended = {description: sig for (_, description), sig in crashed.items()}
    assert not ended, f"calls that ended the process: {ended}"
