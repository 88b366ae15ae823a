"""Random shapes, strides, offsets, dtypes, device indices and sizes thrown at the native entry
points the emulator adds (allocation, set_, storage resize, host aliasing, copies between cards
and the host, IPC handles, pinned memory, graphs, streams and events), with the memory checker
on and off: every case ends in a Python exception or in the result the CPU gives, never in a
crash or a hang.

The cases run in a child process (a crash fails the test instead of killing pytest; a hang hits
the timeout), from a seeded generator, so a failure names its seed and case and replays.
Without the checker, cases never use a view after shrinking its storage: that is undefined
behaviour the checker exists to catch (the CPU inherits it), not an argument an entry point can
refuse.
"""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

from harness import LAST, fresh_process

pytestmark = pytest.mark.emulation_only

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8,
          torch.bool, torch.complex64]
# What a refused call may raise (torch.OutOfMemoryError and AcceleratorError are RuntimeErrors).
REFUSALS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError, OverflowError)


class WrongResult(AssertionError):
    pass


def _device(rng: random.Random) -> str:
    return f"supa:{rng.choice([0, 0, 1, 1, 2, 7, 8, 64, -1])}"


def _shape(rng: random.Random) -> list[int]:
    shape = [rng.choice([0, 1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(0, 4))]
    if shape and rng.random() < 0.05:
        shape[rng.randrange(len(shape))] = rng.choice([-1, -7])
    return shape


def _data(rng: random.Random, shape, dtype) -> torch.Tensor:
    """CPU data of `dtype`: small integers, so every dtype holds them exactly."""
    generator = torch.Generator().manual_seed(rng.randrange(1 << 30))
    values = torch.randint(-3, 4, shape, generator=generator)
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.uint8:
        return values.abs().to(dtype)
    return values.to(dtype)


def _same(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    got = got.cpu()
    # Bit for bit (NaN included: a storage reinterpreted as another dtype may hold them).
    if (got.shape != expected.shape or got.dtype != expected.dtype
            or not torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))):
        raise WrongResult(f"{what}: got {got!r}, expected {expected!r}")


def _extent(size, stride, offset) -> int:
    """Elements of storage a strided view reaches (0 for an empty view)."""
    if any(s == 0 for s in size):
        return 0
    return offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1


# ---- the cases -----------------------------------------------------------------------------------

def case_allocation(rng, checked):
    shape, dtype, device = _shape(rng), rng.choice(DTYPES), _device(rng)
    if rng.random() < 0.05:
        # More than any card holds, or than an int64 of bytes (not merely more than the host has:
        # a card may be configured larger than the host's memory, and filling it would be killed).
        shape = [1 << rng.choice([40, 62])]
    maker = rng.choice(["empty", "zeros", "full", "empty_strided"])
    if maker == "empty_strided":
        stride = [rng.choice([0, 1, 2, 7]) for _ in shape]
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    elif maker == "full":
        t = torch.full(shape, 1, dtype=dtype, device=device)
    else:
        t = getattr(torch, maker)(shape, dtype=dtype, device=device)
    if t.numel() > 1 << 16:  # a zero stride over 2**62 elements: allocated, but no one fills that
        assert t.shape == tuple(shape) and t.untyped_storage().nbytes() <= t.element_size() * 7
        return
    t.fill_(1)
    _same(t, torch.ones(shape, dtype=dtype), f"{maker}{shape} {dtype} on {device} filled with 1")


def case_strided_view(rng, checked):
    dtype, n = rng.choice(DTYPES), rng.randint(0, 40)
    cpu = _data(rng, [n], dtype)
    base = cpu.to("supa")
    ndim = rng.randint(0, 3)
    size = [rng.randint(0, 5) for _ in range(ndim)]
    stride = [rng.choice([0, 1, 2, 3, 9, -1]) for _ in range(ndim)]
    offset = rng.choice([0, 1, 5, n, n + 3, -1])
    view = base.as_strided(size, stride, offset)
    expected = cpu.as_strided(size, stride, offset)
    _same(view, expected, f"as_strided({size}, {stride}, {offset}) of {n} {dtype}")
    if dtype not in (torch.bool, torch.complex64):
        _same(view * 2 + 1, expected * 2 + 1, "an op on the view")


def case_set(rng, checked):
    dtype, n = rng.choice(DTYPES), rng.randint(0, 24)
    cpu = _data(rng, [n], dtype)
    source = cpu.to(_device(rng) if rng.random() < 0.2 else "supa:0")
    ndim = rng.randint(0, 3)
    size = [rng.randint(0, 5) for _ in range(ndim)]
    stride = [rng.choice([0, 1, 2, 5]) for _ in range(ndim)] if rng.random() < 0.7 else None
    offset = rng.choice([0, 1, 3, n, n + 10, -2])
    target = torch.empty(0, dtype=rng.choice([dtype, dtype, torch.float32]), device=rng.choice(["supa:0", "supa:1"]))
    args = (source.untyped_storage(), offset, size) + ((stride,) if stride is not None else ())
    target.set_(*args)
    reference = torch.empty(0, dtype=target.dtype).set_(cpu.untyped_storage(), offset, size,
                                                         *((stride,) if stride is not None else ()))
    if _extent(size, target.stride(), offset) * target.element_size() <= n * cpu.element_size():
        _same(target, reference, f"set_(storage of {n} {dtype}, {offset}, {size}, {stride})")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the grown bytes were never written: initcheck says so
            target.sum() if target.dtype != torch.bool else target.any()


def case_storage_resize(rng, checked):
    dtype, n = rng.choice([torch.float32, torch.int64, torch.uint8]), rng.randint(0, 32)
    cpu = _data(rng, [n], dtype)
    t = cpu.to("supa")
    view = t[rng.randint(0, n):]
    nbytes = rng.choice([0, 1, 3, n * t.element_size() // 2, n * t.element_size(), 4 * n * t.element_size() + 8, -4])
    t.untyped_storage().resize_(nbytes)
    kept = min(nbytes, n * t.element_size()) // t.element_size()
    reach = (view.storage_offset() + view.numel()) * view.element_size() if view.numel() else 0
    if reach <= nbytes:
        _same(view[: max(0, kept - view.storage_offset())], cpu[view.storage_offset():kept],
              f"a view after resizing {n} {dtype} to {nbytes} bytes")
    elif checked:
        try:
            view.sum()
        except torch.supa._memcheck.IllegalAddressError:
            return
        raise WrongResult(f"a view reaching {reach} bytes of a storage resized to {nbytes} was read")
    if rng.random() < 0.5:
        shape = _shape(rng)
        t.resize_(shape)
        t.fill_(2)
        _same(t, torch.full(shape, 2, dtype=dtype), f"resize_({shape})")


def case_host_view(rng, checked):
    dtype = rng.choice(DTYPES)
    cpu = _data(rng, _shape(rng) or [3], dtype)
    t = cpu.to(rng.choice(["supa:0", "supa:1", "cpu"]))
    if t.dim() >= 2 and rng.random() < 0.5:
        t, cpu = t.transpose(0, 1), cpu.transpose(0, 1)
    if rng.random() < 0.3 and t.numel():
        t, cpu = t.flatten()[1:], cpu.flatten()[1:]
    alias = torch.supa._native()._host_view(t)
    _same(alias, cpu, "a host view")
    if alias.numel() and t.device.type == "supa":
        alias.fill_(1)  # the same memory: the device tensor sees the write
        _same(t, torch.ones_like(cpu), "the device tensor after writing its host view")


def case_copy(rng, checked):
    src_dtype, dst_dtype = rng.choice(DTYPES), rng.choice(DTYPES)
    shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
    cpu = _data(rng, shape, src_dtype)
    places = ["cpu", "pinned", "supa:0", "supa:1", "supa:2"]
    src_place, dst_place = rng.choice(places), rng.choice(places)
    src = cpu.pin_memory() if src_place == "pinned" else cpu.to(src_place)
    if len(shape) >= 2 and rng.random() < 0.5:
        src, cpu = src.transpose(0, 1), cpu.transpose(0, 1)
    non_blocking = rng.random() < 0.5
    if rng.random() < 0.5:
        out = src.to(dst_place.replace("pinned", "cpu"), dtype=dst_dtype, non_blocking=non_blocking)
    else:
        dst = torch.empty(cpu.shape, dtype=dst_dtype, pin_memory=dst_place == "pinned",
                          device=dst_place.replace("pinned", "cpu"))
        if rng.random() < 0.2:
            dst = torch.empty(_shape(rng), dtype=dst_dtype, device=dst.device)  # a mismatched shape
        out = dst.copy_(src, non_blocking=non_blocking)
    torch.supa.synchronize()
    _same(out, cpu.to(dst_dtype).expand(out.shape) if out.shape != cpu.shape else cpu.to(dst_dtype),
          f"{src_place} {src_dtype} -> {dst_place} {dst_dtype}")


def case_ipc(rng, checked):
    device = rng.choice([0, 1])
    cpu = _data(rng, [rng.randint(0, 16)], torch.float32)
    x = cpu.to(f"supa:{device}")
    other = torch.arange(4.0, device="supa:0")
    _, fd, nbytes = x.untyped_storage()._share_supa_()
    _, other_fd, other_nbytes = other.untyped_storage()._share_supa_()
    handle = rng.choice([(fd, nbytes), (fd, nbytes), (fd, nbytes + rng.choice([-4, 4, 1 << 40])),
                         (other_fd, other_nbytes), (rng.choice([-1, 0, 2, 9999]), nbytes)])
    into = rng.choice([device, 0, 1, 8, -1])
    storage = torch.UntypedStorage._new_shared_supa(into, *handle)
    mapped = torch.empty(0, device=f"supa:{into}").set_(storage)
    expected = cpu if handle == (fd, nbytes) else torch.arange(4.0) if handle == (other_fd, other_nbytes) else None
    if expected is None:
        raise WrongResult(f"a handle {handle} that names no block was mapped (the block is {fd}, {nbytes})")
    _same(mapped, expected, "a mapped shared block")


def case_pinned(rng, checked):
    shape, dtype = _shape(rng), rng.choice(DTYPES)
    if rng.random() < 0.5:
        host = torch.empty(shape, dtype=dtype, pin_memory=True)
        host.copy_(_data(rng, host.shape, dtype))
    else:
        host = _data(rng, shape, dtype).pin_memory()
    if host.numel() and not host.is_pinned():  # an empty one holds no memory to pin (as on CUDA)
        raise WrongResult("pin_memory() gave memory that is not pinned")
    device = host.to(_device(rng), non_blocking=True)
    back = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    back.copy_(device, non_blocking=True)
    torch.supa.synchronize()
    _same(back, host, "pinned -> device -> pinned")


def case_graph(rng, checked):
    shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 2))]
    x = torch.zeros(shape, device="supa")
    graph = torch.supa.SUPAGraph()
    misuse = rng.choice([None, None, None, "replay first", "mode", "pool"])
    if misuse == "replay first":
        graph.replay()
    scale, shift = rng.randint(-3, 3), rng.randint(-3, 3)
    mode = "sideways" if misuse == "mode" else rng.choice(["global", "thread_local", "relaxed"])
    pool = (rng.randrange(1 << 20), rng.randrange(1 << 20)) if misuse == "pool" else None
    # capture_begin/end directly: torch.supa.graph also runs gc.collect(), 0.6 s a case.
    side = torch.supa.Stream()
    side.wait_stream(torch.supa.current_stream())
    with torch.supa.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode=mode)
        try:
            y = x * scale + shift
        finally:
            graph.capture_end()
    torch.supa.current_stream().wait_stream(side)
    values = _data(rng, shape, torch.float32)
    x.copy_(values)
    graph.replay()
    _same(y, values * scale + shift, "a replayed graph")


def case_stream_event(rng, checked):
    device = _device(rng)
    stream = torch.supa.Stream(device=device, priority=rng.choice([0, -1, 1, -5, 3]))
    event = torch.supa.Event(enable_timing=rng.random() < 0.5, interprocess=rng.random() < 0.2)
    other = torch.supa.Event(enable_timing=True)
    x = torch.ones(4, device=device)
    with torch.supa.stream(stream):
        y = x * 2
        if rng.random() < 0.8:
            event.record(stream)
    choice = rng.choice(["wait", "query", "sync", "elapsed", "wait_stream"])
    if choice == "wait":
        torch.supa.current_stream(rng.choice([0, 1])).wait_event(event)
    elif choice == "query":
        event.query()
    elif choice == "sync":
        event.synchronize()
    elif choice == "elapsed":
        other.record()
        event.elapsed_time(other)
    else:
        torch.supa.current_stream().wait_stream(stream)
    torch.supa.synchronize()
    _same(y, torch.full((4,), 2.0), "work on a side stream")


CASES = [case_allocation, case_strided_view, case_set, case_storage_resize, case_host_view, case_copy, case_ipc,
         case_pinned, case_graph, case_stream_event]


def run_cases(seed: int, count: int) -> dict:
    """Runs `count` cases from `seed` in this process (a fresh interpreter); returns how many ended in
    each outcome, or fails on a wrong result or an exception that is not a refusal, naming the case."""
    warnings.simplefilter("ignore")
    checked = "memory" in os.environ.get("SUPA_EMU_SANITIZE", "")
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    for index in range(count):
        case = rng.choice(CASES)
        case_rng = random.Random(rng.randrange(1 << 62))
        where = f"seed {seed} case {index} ({case.__name__})"
        try:
            case(case_rng, checked)
            outcome = "ok"
        except WrongResult as error:
            raise AssertionError(f"{where}: {error}") from error
        except REFUSALS as error:
            outcome = type(error).__name__
            assert str(error).strip(), f"{where}: {outcome} without a message"
        except BaseException as error:
            raise AssertionError(f"{where}: unexpected {type(error).__name__}: {error}") from error
        outcomes[f"{case.__name__}: {outcome}"] = outcomes.get(f"{case.__name__}: {outcome}", 0) + 1
    return outcomes


def _fuzz_env(sanitize: str | None) -> dict:
    return {"SUPA_EMU_SANITIZE": sanitize, "BRTB_TRANSFER_SILENCE": "1"}


def _fuzz(seed: int, count: int, sanitize: str | None) -> None:
    result = fresh_process(run_cases, seed, count, env=_fuzz_env(sanitize), timeout=60 + count, check=False)
    assert result.returncode == 0, (f"fuzz seed {seed} ({count} cases, SUPA_EMU_SANITIZE={sanitize}) ended with "
                                    f"{result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    _check_outcomes(result.value, count)


def _check_outcomes(outcomes: dict, count: int) -> None:
    # Every entry point was reached, and most cases got past the argument checks.
    assert {case.__name__ for case in CASES} == {key.split(":")[0] for key in outcomes}, outcomes
    assert sum(n for key, n in outcomes.items() if key.endswith(": ok")) > count // 3, outcomes


# Last in an interpreter shared with other tests: a case that crashes it ends it.
_SHORT_FUZZ = {sanitize: fresh_process(run_cases, 1, 150, env=_fuzz_env(sanitize), shared=LAST, timeout=60 + 150)
               for sanitize in [None, "memory"]}


@pytest.mark.parametrize("sanitize", list(_SHORT_FUZZ))
def test_fuzz_native_entry_points(sanitize):
    result = _SHORT_FUZZ[sanitize].result(check=False)
    assert result.error is None, f"fuzz seed 1 (150 cases, SUPA_EMU_SANITIZE={sanitize}): {result.describe(3000)}"
    _check_outcomes(result.value, 150)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
@pytest.mark.parametrize("sanitize", [None, "memory"])
def test_fuzz_native_entry_points_at_length(seed, sanitize):
    _fuzz(seed=seed, count=750, sanitize=sanitize)
