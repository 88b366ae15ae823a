"""An operator kernel's provisional blocks (csrc/runtime/provisional_blocks.cpp) while another thread
uses the same card: an operator whose first result must be placed anew sets its other results
aside until it hands them back, and another thread's takes, placements and frees meanwhile never
meet them. Run in an interpreter of its own under the memory checker (the GPU trace the test
hooks into stays on for the rest of a process). And an operator whose results do not fit the card:
an out-of-memory error, after which the process goes on. And set-aside blocks whose addresses
the card gave away while another result of their call was placed."""

import threading

import pytest
import torch

from harness import fresh_process

pytestmark = pytest.mark.emulation_only


def _results_set_aside_against_a_second_thread(rounds: int) -> dict:
    # torch.unique(return_inverse=, return_counts=) hands back its results in another order than
    # its CPU kernel allocated them, so the first is placed anew and the other two wait aside while
    # it is. After each block handed out on this thread (a result committed), the second thread
    # takes, places and frees blocks of the results' sizes before this one goes on: were an
    # address set aside given away, a block of the second thread would land on it.
    from supa_emu.supa import _gpu_trace

    assert torch.supa._memcheck.memory_checker.enabled
    device = torch.device("supa", 0)
    values = torch.randn(512).round()
    expected = torch.unique(values, return_inverse=True, return_counts=True)
    x = values.to(device)
    here = threading.get_ident()
    turn, turn_done = threading.Event(), threading.Event()
    state = {"in_op": False, "stop": False, "turns": 0}

    def second_thread():
        while True:
            turn.wait()
            turn.clear()
            if state["stop"]:
                return
            blocks = [torch.full((n,), 7.0, device=device) for n in (16, 16, 16, 16, 1024, 1024, 1024)]
            doubled = [b * 2 for b in blocks]  # taken from the card and committed
            del blocks, doubled
            state["turns"] += 1
            turn_done.set()

    def after_allocation(address: int) -> None:
        if state["in_op"] and threading.get_ident() == here:
            turn.set()
            turn_done.wait()
            turn_done.clear()

    _gpu_trace.register_callback_for_memory_allocation(after_allocation)
    other = threading.Thread(target=second_thread, daemon=True)
    other.start()
    torch.supa.synchronize()
    before = torch.supa.memory_allocated(device)
    wrong = 0
    for _ in range(rounds):
        state["in_op"] = True
        results = torch.unique(x, return_inverse=True, return_counts=True)
        state["in_op"] = False
        wrong += sum(not torch.equal(got.cpu(), want) for got, want in zip(results, expected))
        del results
    state["stop"] = True
    turn.set()
    other.join(60)
    return {"wrong": wrong, "turns": state["turns"], "leaked": torch.supa.memory_allocated(device) - before}


def test_results_set_aside_are_no_other_threads_blocks():
    outcome = fresh_process(_results_set_aside_against_a_second_thread, 200, env={"SUPA_EMU_SANITIZE": "memory"}).value
    assert outcome["wrong"] == 0, f"{outcome['wrong']} results hold bytes of the second thread's blocks"
    assert outcome["leaked"] == 0
    assert outcome["turns"] == 200 * 3  # the second thread ran after each result


def _results_that_do_not_fit() -> dict:
    # An operator's CPU kernel allocates its results provisionally, and the card places them when
    # it hands them back; where no room is left, placing raises. The kernel's storage then still
    # holds the provisional block and frees it as the error unwinds (once, the block had been
    # forgotten, its free reached the card as an unknown pointer and the process aborted). In
    # shapes mode the results the shape rule tells do not fit: that is the error, and no kernel
    # runs after it (once, the rule's error was taken for a rule that could not tell).
    from supa_emu import shapes

    mib = 1 << 20
    device = torch.device("supa", 0)
    total = torch.supa.get_device_properties(device).total_memory
    a = torch.arange(2 * mib, dtype=torch.float32, device=device).flip(0)  # 8 MiB, in a 20 MiB segment
    fill = torch.empty(total - 20 * mib, dtype=torch.uint8, device=device)  # 12 MiB left free
    before = [torch.supa.memory_allocated(device), torch.supa.memory_reserved(device)]
    ooms = torch.supa.memory_stats(device)["num_ooms"]
    refused = []
    for name, op in (("cat", lambda: torch.cat([a, a])),  # one 16 MiB result
                     ("sort", lambda: torch.sort(a))):  # 8 MiB of values fit, 16 MiB of indices do not
        try:
            op()
        except torch.OutOfMemoryError as error:
            refused.append([name, str(error).split(".")[0]])
    after = [torch.supa.memory_allocated(device), torch.supa.memory_reserved(device)]
    del fill
    joined, (values, indices) = torch.cat([a, a]), torch.sort(a)
    return {"refused": refused, "ooms": torch.supa.memory_stats(device)["num_ooms"] - ooms,
            "unchanged": after == before,
            "kernels_ran": [note["op"] for note in shapes.notes()],
            "shapes": [list(joined.shape), list(values.shape), str(indices.dtype)],
            "values": [float(joined[-1]), float(values[1]), int(indices[1])]}


@pytest.mark.parametrize("mode", ["compute", "shapes"])
def test_results_that_do_not_fit_the_card_raise_out_of_memory(mode):
    env = {"SUPA_EMU_MEMORY": "256MiB", "SUPA_EMU_DEVICE_COUNT": "1", "SUPA_PLAN_MODE": mode}
    outcome = fresh_process(_results_that_do_not_fit, env=env).value
    assert outcome["refused"] == [["cat", "SUPA out of memory"], ["sort", "SUPA out of memory"]]
    assert outcome["ooms"] == 2
    assert outcome["unchanged"], "a refused result left blocks counted on the card"
    assert outcome["kernels_ran"] == []
    assert outcome["shapes"] == [[4 << 20], [2 << 20], "torch.int64"]
    if mode == "compute":
        assert outcome["values"] == [0.0, 1.0, (2 << 20) - 2]


def _set_aside_address_released_to_a_second_thread(rounds: int) -> dict:
    # native_batch_norm's CPU kernel allocates its output (4 MiB, the large pool: no free block
    # fits, so host memory) before save_mean and save_invstd (1 KiB each, taken from the free small
    # page 0). Handing the output back places it first: the two small blocks go aside, and the
    # card, full, unmaps the free small page to map a large one for it, so the two cannot take
    # their addresses back. Right after (the output's block reported on this thread), the second
    # thread frees a large page and maps small page 0 again: its blocks land where the two were.
    # Until their commit the two are their call's alone, found by the pointer their storage holds,
    # with no claim on an address the card gave away (once, their table entries stayed there, and
    # the second thread's kernel taking that address failed an internal assert).
    from supa_emu.supa import _gpu_trace

    assert torch.supa._memcheck.memory_checker.enabled
    mib = 1 << 20
    device = torch.device("supa", 0)
    here = threading.get_ident()
    state = {"armed": False, "errors": [], "landed": []}
    held = {}

    def second_thread():
        try:
            del held["page"]
            torch.supa.empty_cache()  # the large page goes back: room for small page 0 again
            a = torch.ones(256, device=device)
            b = a * 2  # its kernel's result is taken at the second 1 KiB of small page 0
            state["landed"].append(bool(torch.equal(b.cpu(), torch.full((256,), 2.0))))
        except Exception as error:  # noqa: BLE001  (reported by the test)
            state["errors"].append(repr(error))

    def after_allocation(address: int) -> None:
        if state["armed"] and threading.get_ident() == here:
            state["armed"] = False
            other = threading.Thread(target=second_thread)
            other.start()
            other.join(60)

    _gpu_trace.register_callback_for_memory_allocation(after_allocation)
    wrong, retries = 0, 0
    for _ in range(rounds):
        host = torch.randn(64, 256, 8, 8)
        expected = torch.ops.aten.native_batch_norm(host, None, None, None, None, True, 0.1, 1e-5)
        x = host.to(device)  # 4 MiB of large page 0
        fill = torch.empty(20 * mib - x.nbytes, dtype=torch.uint8, device=device)  # the rest of it
        held["page"] = torch.empty(20 * mib, dtype=torch.uint8, device=device)  # large page 1
        small = [torch.empty(mib, dtype=torch.uint8, device=device) for _ in range(4)]  # small pages 0, 1
        del small[:2]  # page 0 free, page 1 (full) keeps the small range; 18 MiB of 62 left
        before = torch.supa.memory_stats(device)["num_alloc_retries"]
        state["armed"] = True
        try:
            results = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
        except Exception as error:  # noqa: BLE001  (reported by the test)
            state["errors"].append(repr(error))
            results = ()
        retries += torch.supa.memory_stats(device)["num_alloc_retries"] - before
        wrong += sum(not torch.allclose(got.cpu(), want) for got, want in zip(results, expected))
        del results, x, fill, small
        held.clear()
        torch.supa.empty_cache()
    return {"errors": state["errors"], "landed": state["landed"], "wrong": wrong, "retries": retries,
            "allocated": torch.supa.memory_allocated(device)}


def test_set_aside_blocks_do_not_claim_an_address_the_card_gave_away():
    env = {"SUPA_EMU_SANITIZE": "memory", "SUPA_EMU_MEMORY": "62MiB", "SUPA_EMU_DEVICE_COUNT": "1",
           "PYTORCH_SUPA_ALLOC_CONF": "expandable_segments:True"}
    outcome = fresh_process(_set_aside_address_released_to_a_second_thread, 3, env=env).value
    assert outcome["errors"] == []
    assert outcome["retries"] == 3, "the output's placement did not unmap the small page"
    assert outcome["landed"] == [True] * 3
    assert outcome["wrong"] == 0
    assert outcome["allocated"] == 0
