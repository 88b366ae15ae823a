"""The emulated card's block policy (supa_emu/csrc/runtime/card_memory.cpp), tested in C++.

The card model has no PyTorch dependency, so tests/cpp/card_memory_test.cpp compiles against it
alone with the compiler the native core uses, in about a second, and checks the policy directly:
request rounding, blocks never split or coalesced, which cached block serves a request, garbage
collection, the capacity and host-memory decisions, operator kernels' provisional blocks, the
backing of shapes mode (reserved address space, blocks that read zeros) and expandable segments.
test_memory.py checks the same policy through torch.supa's statistics.
"""

import pathlib

import harness
from supa_emu import native, native_compile

TEST_SOURCE = pathlib.Path(__file__).parent / "cpp" / "card_memory_test.cpp"
RUNTIME = native.SOURCE_DIR / "runtime"
# The card model and what it is built on.
CARD_MODEL = [RUNTIME / "card_memory.cpp", RUNTIME / "block_splits.cpp", RUNTIME / "host_memory.cpp",
              RUNTIME / "expandable_segments.cpp"]

# Every case main() runs; the program must report each one.
CASES = (
    "round_up_sizes",
    "segment_sizes",
    "oversize_marks",
    "small_requests_split_a_segment",
    "large_request_whole_block_handout",
    "small_whole_block_below_512_remainder",
    "best_fit_then_lowest_address",
    "coalescing_on_free",
    "split_segment_is_not_released",
    "reuse_only_within_pool",
    "reuse_only_within_stream",
    "small_and_large_pools_apart",
    "oversize_blocks",
    "capacity_limit",
    "full_card_releases_free_segments",
    "garbage_collection_least_recently_freed_first",
    "host_out_of_memory",
    "taken_and_given_back",
    "taken_again_at_its_address",
    "random_requests_take_the_best_fit",
    "reserved_address_space_backing",
    "lowest_card_address_whatever_the_host_address",
    "expandable_segments_map_and_unmap_pages",
    "expandable_segments_setting_and_limit",
)


def test_card_memory_block_policy(tmp_path):
    program = tmp_path / "card_memory_test"
    harness.fresh_process([native_compile.compiler(), native_compile.CXX_STD, "-O1", "-Wall", "-Wextra", "-Werror",
                           f"-I{RUNTIME}", TEST_SOURCE, *CARD_MODEL, "-o", program], timeout=300)
    run = harness.fresh_process([program], timeout=60)
    reported = [line for line in run.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert reported == [f"ok {name}" for name in CASES], run.stdout
