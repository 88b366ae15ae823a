"""The fixtures of the torch.supa memory tests (test_memory*.py: each test starts without garbage,
allocator settings put back) and their lookups of the card's segments."""

import gc

import pytest
import torch

pytest.importorskip("torch.supa", reason="needs the supa device (SUPA_EMULATE=1 or a real card)")
import torch_supa._C  # noqa: E402  (clears the BLAS workspaces)


MiB = 1 << 20
ROUNDING = 512 + 32  # the allocator pads each block and rounds it up to 512 bytes


@pytest.fixture(scope="module", autouse=True)
def no_garbage_of_earlier_tests():
    # Nor the BLAS workspaces their matrix products left (the tests below count bytes from zero).
    gc.collect()
    torch_supa._C._supa_clearSublasWorkspaces()


@pytest.fixture(autouse=True)
def initialised(no_garbage_of_earlier_tests):
    # A test starts without garbage: what earlier modules left is collected above, what each test
    # of this module leaves is collected after it (a collection costs ~0.1 s in a full run).
    torch.supa.init()
    yield
    gc.collect()


def segment_holding(address):
    """The snapshot's segment that holds `address` (earlier files may leave live blocks whose
    segments a new small tensor shares)."""
    (seg,) = [s for s in torch.supa.memory_snapshot() if s["address"] <= address < s["address"] + s["total_size"]]
    return seg


def last_device():
    # The highest-numbered device is the least likely to hold tensors from other tests.
    return torch.supa.device_count() - 1


# ---- allocator settings that change accounting -------------------------------------------------

@pytest.fixture
def allocator_settings_restored():
    """The settings are process-wide: put back what the test changed, and start from an empty cache."""
    from supa_emu.supa import _allocator_config

    saved = dict(_allocator_config._settings)
    torch.supa.empty_cache()
    yield
    torch.supa.empty_cache()
    _allocator_config._settings.update(saved)
    torch.supa.set_per_process_memory_fraction(1.0)
    torch.supa._native()._set_allocator_knobs(saved["max_split_size"], saved["garbage_collection_threshold"],
                                              saved["roundup_power2_divisions"],
                                              saved["graph_capture_record_stream_reuse"],
                                              saved["expandable_segments"])
