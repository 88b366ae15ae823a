"""The caching allocator's settings (PYTORCH_SUPA_ALLOC_CONF, PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF,
torch.supa.memory._set_allocator_settings)
and what they change in the accounting."""

import re

import pytest
from harness import fresh_process
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
from memory_fixtures import (  # noqa: F401  (fixtures)
    MiB, allocator_settings_restored, initialised, last_device, no_garbage_of_earlier_tests)


@pytest.mark.emulation_only
def test_allocator_backend_and_settings():
    assert torch.supa.get_allocator_backend() == "native"
    with pytest.warns(UserWarning, match="not modelled by the emulator"):
        torch.supa._set_allocator_settings("pinned_use_cuda_host_register:True,pinned_num_register_threads:8")
    settings = torch.supa.memory._snapshot()["allocator_settings"]
    assert settings["pinned_use_supa_host_register"] is True
    assert settings["pinned_num_register_threads"] == 8
    torch.supa._set_allocator_settings("pinned_use_cuda_host_register:False,pinned_num_register_threads:1")


BAD_ALLOCATOR_SETTINGS = {
    "no_such_knob:1": "unrecognized or malformed entry 'no_such_knob:1'; known keys: ",
    "pinned_num_register_threads:many": "invalid value 'many' for pinned_num_register_threads",
    "pinned_num_register_threads:3": "pinned_num_register_threads: must be a power of two, at most 128",
    "pinned_reserve_segment_size_mb:0": "pinned_reserve_segment_size_mb: must be greater than 0",
    "backend:cudaMallocAsync": "only backend is 'native'",
    "max_split_size_mb:8": "max_split_size_mb: too small, must be >= 20",
    "garbage_collection_threshold:1.5": "garbage_collection_threshold: must be between 0.0 and 1.0",
    "roundup_power2_divisions:3": "roundup_power2_divisions: the number of divisions must be a power of two",
    # A rejected string changes nothing, not even its valid entries.
    "garbage_collection_threshold:0.5,no_such_knob:1": "unrecognized or malformed entry 'no_such_knob:1'",
}


@pytest.mark.emulation_only
@pytest.mark.parametrize("setting", list(BAD_ALLOCATOR_SETTINGS))
def test_allocator_settings_reject_bad_input(setting):
    before = torch.supa.memory._snapshot()["allocator_settings"]
    with pytest.raises(RuntimeError, match=re.escape(BAD_ALLOCATOR_SETTINGS[setting])):
        torch.supa._set_allocator_settings(setting)
    assert torch.supa.memory._snapshot()["allocator_settings"] == before


@pytest.mark.emulation_only
def test_roundup_power2_divisions_rounds_requests(allocator_settings_restored):
    size = 3 * MiB + 100  # +32 bytes of padding: between 2 MiB and 4 MiB
    held = torch.supa.memory_allocated()  # what earlier tests in this process still hold
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == (size + 32 + 511) // 512 * 512
    del x
    torch.supa._set_allocator_settings("roundup_power2_divisions:4")  # 2, 2.5, 3, 3.5, 4 MiB
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == 3 * MiB + MiB // 2
    del x
    # Per-interval form: one division below 512 MiB, so the plain 512-byte rounding applies here.
    torch.supa._set_allocator_settings("roundup_power2_divisions:[256:1,>:4]")
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == (size + 32 + 511) // 512 * 512
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == [1] * 9 + [4] * 7
    del x
    # 'N:d' names the interval [N MiB, 2N MiB): 8 steps of 512 KiB between 4 and 8 MiB.
    torch.supa._set_allocator_settings("roundup_power2_divisions:[4:8,>:1]")
    x = torch.empty(5 * MiB + 100, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == 5 * MiB + MiB // 2


# PyTorch 2.13's allocator config reads the list form so (the value each of the 16 intervals from
# 1 MiB gets): an entry sets its own interval, the first also those below, '>' those after the
# last named; the rest stay 0.
ROUNDUP_LISTS = {
    "[64:8,128:2,256:2,512:2,1024:1,>:1]": [8] * 7 + [2] * 3 + [1] * 6,
    "[256:1,>:4]": [1] * 9 + [4] * 7,
    "[1:2,64:8,>:1]": [2, 0, 0, 0, 0, 0, 8] + [1] * 9,
    "[64:8,1024:1]": [8] * 7 + [0, 0, 0, 1] + [0] * 5,
    "[256:1,64:8]": [1] * 6 + [8, 1, 1] + [0] * 7,
    "[>:2]": [0] + [2] * 15,
}


@pytest.mark.emulation_only
@pytest.mark.parametrize("text", list(ROUNDUP_LISTS))
def test_roundup_power2_divisions_list_reads_as_pytorchs(text, allocator_settings_restored):
    torch.supa._set_allocator_settings(f"roundup_power2_divisions:{text}")
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == ROUNDUP_LISTS[text]


@pytest.mark.emulation_only
def test_each_settings_string_resets_the_accounting_settings_it_does_not_name(allocator_settings_restored):
    size = 3 * MiB + 100  # +32 bytes of padding
    held = torch.supa.memory_allocated()
    with pytest.warns(UserWarning, match="not modelled"):
        torch.supa._set_allocator_settings("roundup_power2_divisions:4,max_split_size_mb:40,"
                                           "garbage_collection_threshold:0.5,pinned_num_register_threads:8")
    torch.supa._set_allocator_settings("expandable_segments:False")
    # As on CUDA: rounding, max_split_size and the threshold are back to their defaults ...
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == (size + 32 + 511) // 512 * 512
    assert torch.supa.memory_stats()["max_split_size"] == -1
    settings = torch.supa.memory._snapshot()["allocator_settings"]
    assert settings["garbage_collection_threshold"] == 0.0
    # ... and a setting the string does not name otherwise keeps its value.
    assert settings["pinned_num_register_threads"] == 8
    torch.supa._set_allocator_settings("pinned_num_register_threads:1")


@pytest.mark.emulation_only
def test_max_split_size_counts_oversize_blocks_and_lets_them_serve_smaller_requests(allocator_settings_restored):
    torch.supa._set_allocator_settings("max_split_size_mb:32")
    stats = torch.supa.memory_stats()
    assert stats["max_split_size"] == 32 * MiB
    segments = stats["segment.all.current"]
    allocated = torch.supa.memory_allocated()
    big = torch.empty(40 * MiB, dtype=torch.uint8, device="supa")
    stats = torch.supa.memory_stats()
    assert (stats["oversize_allocations.current"], stats["oversize_segments.current"]) == (1, 1)
    del big
    assert torch.supa.memory_stats()["oversize_allocations.current"] == 0
    # A request below max_split_size never takes an oversize block: a new segment.
    small = torch.empty(30 * MiB, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_stats()["segment.all.current"] == segments + 2
    # An oversize request takes a cached oversize block less than 20 MiB larger, whole.
    reused = torch.empty(35 * MiB, dtype=torch.uint8, device="supa")
    stats = torch.supa.memory_stats()
    assert stats["segment.all.current"] == segments + 2 and stats["oversize_allocations.current"] == 1
    assert torch.supa.memory_allocated() - allocated == 30 * MiB + 40 * MiB
    del small, reused


@pytest.mark.emulation_only
def test_garbage_collection_threshold_releases_the_oldest_cached_blocks():
    # Exact reserved figures need a card no other test left blocks on: a fresh process.
    fresh_process(_garbage_collection_threshold_case)


def _garbage_collection_threshold_case():
    # Blocks of 10 MiB or more get segments of their own size (rounded to 2 MiB).
    torch.supa.set_per_process_memory_fraction(1 / 256)
    limit = torch.supa.get_device_properties(0).total_memory // 256
    eighth = limit // 8 - 512
    blocks = [torch.empty(eighth, dtype=torch.uint8, device="supa") for _ in range(3)]
    addresses = [b.data_ptr() for b in blocks]
    while blocks:  # freed in order 0, 1, 2
        del blocks[0]
    assert torch.supa.memory_reserved() == 3 * limit // 8
    torch.supa._set_allocator_settings("garbage_collection_threshold:0.5")
    frees = torch.supa.memory_stats()["num_device_free"]
    fresh = torch.empty(limit // 4 - 512, dtype=torch.uint8, device="supa")  # 3/8 + 2/8 > 1/2: collect
    # Only the least recently freed block went back: 2/8 + 2/8 is within the threshold.
    assert torch.supa.memory_stats()["num_device_free"] == frees + 1
    assert torch.supa.memory_reserved() == 4 * limit // 8
    cached = {s["address"] for s in torch.supa.memory_snapshot() if s["allocated_size"] == 0}
    assert cached == set(addresses[1:])
    del fresh


@pytest.mark.emulation_only
def test_pytorchs_own_settings_entry_sets_the_supa_allocator(allocator_settings_restored):
    size = 3 * MiB + 100  # +32 bytes of padding
    held = torch.supa.memory_allocated()
    torch._C._accelerator_setAllocatorSettings("roundup_power2_divisions:4")
    x = torch.empty(size, dtype=torch.uint8, device="supa")
    assert torch.supa.memory_allocated() - held == 3 * MiB + MiB // 2
    del x
    # A bad entry raises ValueError, as CUDA's allocator config does, and changes nothing.
    for bad in ("foo:1,bar:2", "release_lock_on_cudamalloc:none", "pinned_num_register_threads:none",
                "pinned_num_register_threads:1024"):
        with pytest.raises(ValueError):
            torch._C._accelerator_setAllocatorSettings(bad)
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == [4] * 16
    torch._C._accelerator_setAllocatorSettings("")
    assert torch.supa.memory._snapshot()["allocator_settings"]["roundup_power2_divisions"] == [0] * 16


def _allocated_and_max_split_size() -> list:
    x = torch.empty(3 * 2**20 + 100, dtype=torch.uint8, device="supa")
    seen = [torch.supa.memory_allocated(), torch.supa.memory_stats()["max_split_size"]]
    del x
    return seen


@pytest.mark.emulation_only
def test_allocator_conf_variable_applies_at_start_and_is_validated():
    result = fresh_process(_allocated_and_max_split_size,
                           env={"PYTORCH_SUPA_ALLOC_CONF": "roundup_power2_divisions:4,max_split_size_mb:64"})
    assert result.value == [3 * MiB + MiB // 2, 64 * MiB]
    bad = fresh_process(_allocated_and_max_split_size, env={"PYTORCH_SUPA_ALLOC_CONF": "max_split_size_mb:lots"},
                        check=False)
    assert bad.returncode != 0
    assert "PYTORCH_SUPA_ALLOC_CONF='max_split_size_mb:lots': invalid value 'lots' for max_split_size_mb" in bad.stderr


def _settings_at_start() -> list:
    torch.empty(1, device="supa")
    settings = torch.supa.memory._snapshot()["allocator_settings"]
    return [settings["expandable_segments"], settings["max_split_size"]]


NO_ALLOC_CONF = dict.fromkeys(("PYTORCH_SUPA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))


@pytest.mark.emulation_only
@pytest.mark.parametrize("variables, expected", [
    # CUDA's variable alone, as the OOM message and PyTorch's test helpers have it
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, [True, -1]),
    # the device-generic one before CUDA's, SUPA's before both: the first set wins, whole
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
     [False, 64 * MiB]),
    ({"PYTORCH_SUPA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
     [True, -1]),
], ids=["cuda", "generic-over-cuda", "supa-over-generic"])
def test_allocator_conf_variables_first_set_wins(variables, expected):
    result = fresh_process(_settings_at_start, env={**NO_ALLOC_CONF, **variables}, torch_first=False)
    assert result.value == expected


@pytest.mark.emulation_only
def test_a_bad_allocator_conf_names_the_variable_it_came_from():
    bad = fresh_process(_settings_at_start, env={**NO_ALLOC_CONF, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:maybe"},
                        check=False, torch_first=False)
    assert bad.returncode != 0
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:maybe': invalid value 'maybe' for expandable_segments" in bad.stderr


@pytest.mark.emulation_only
def test_disabling_the_caching_allocator_warns_that_it_is_not_modelled():
    with pytest.warns(UserWarning, match="not modelled by the emulator"):
        torch.supa.caching_allocator_enable(False)
    torch.supa.caching_allocator_enable(True)
