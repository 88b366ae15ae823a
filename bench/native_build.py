"""What a cold build of the native core costs, unit by unit, and what a precompiled header would change.

    python bench/native_build.py [--part cold|units|pch|all] [--rounds 1]

cold:  builds the core into a fresh temporary cache, as the first `import torch` with
       SUPA_EMULATE=1 on a new machine does (the build's own lines give each unit's time), and
       prints the wall time and the compiler processes' CPU time (user + system), which the
       machine's load changes far less than the wall time.
units: compiles each unit alone, one at a time: its CPU time for a full compile and for
       -fsyntax-only (parsing and template instantiation, mostly torch's headers).
pch:   builds a precompiled header of the torch headers the units share (ATen/ATen.h and
       torch/library.h) with exactly the units' flags, then compiles each unit with and without
       it (`-include`), taking turns; prints the header's own CPU time and the totals. A unit that
       does not use the header (GCC falls back to the text, -Winvalid-pch says so) is reported.

Nothing here changes the cache the emulator uses. The load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

from harness import load
from supa_emu import native, native_compile

# With emulation on, importing torch (for its version) would load or build the core in the user's cache.
os.environ.pop("SUPA_EMULATE", None)

SHARED_HEADERS = ("ATen/ATen.h", "torch/library.h")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _compile(arguments: list[str]) -> tuple[float, str]:
    """CPU seconds of one compiler run, and its stderr; exits with the output if it fails."""
    before = _children_cpu()
    result = subprocess.run([native_compile.compiler(), *native_compile.compile_flags(native.MODULE_NAME),
                             *arguments], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"compiler failed:\n{result.stderr}")
    return _children_cpu() - before, result.stderr


def _unit_sources(work: pathlib.Path) -> dict[str, pathlib.Path]:
    """{unit: the file the compiler gets}, generating the unity files as the build does."""
    return {name: files[0] if len(files) == 1 else native._unity_source(work / f"{name}.cpp", files)
            for name, files in native._units().items()}


def cold(work: pathlib.Path) -> None:
    logging.basicConfig(format="%(message)s")
    native_compile.torch_build()  # torch imported before the clock starts
    cache = work / "cache"
    cache.mkdir(mode=0o755)
    cpu, start = _children_cpu(), time.monotonic()
    native.ready_library(cache)
    print(f"cold build: wall {time.monotonic() - start:.1f} s, compiler CPU {_children_cpu() - cpu:.1f} s "
          f"({native_compile.jobs()} compiler processes at a time)")


def units(work: pathlib.Path) -> None:
    total = [0.0, 0.0]
    for name, source in _unit_sources(work).items():
        full, _ = _compile(["-c", str(source), "-o", str(work / f"{name}.o")])
        syntax, _ = _compile(["-fsyntax-only", str(source)])
        total = [total[0] + full, total[1] + syntax]
        print(f"unit {name:10s} CPU {full:6.1f} s, of which parsing (-fsyntax-only) {syntax:5.1f} s", flush=True)
    print(f"all units: CPU {total[0]:.1f} s, parsing {total[1]:.1f} s")


def pch(work: pathlib.Path, rounds: int) -> None:
    header = work / "shared_torch_headers.h"
    header.write_text("".join(f"#include <{h}>\n" for h in SHARED_HEADERS))
    built, _ = _compile(["-x", "c++-header", str(header), "-o", str(header) + ".gch"])
    size = pathlib.Path(str(header) + ".gch").stat().st_size
    print(f"precompiled header of {', '.join(SHARED_HEADERS)}: CPU {built:.1f} s, {size / 2**20:.0f} MiB", flush=True)
    plain_total = with_total = 0.0
    for name, source in _unit_sources(work).items():
        plain, with_pch = [], []
        for _ in range(rounds):  # taking turns, so that the machine's drift hits both alike
            plain.append(_compile(["-c", str(source), "-o", str(work / f"{name}.o")])[0])
            cpu, stderr = _compile(["-Winvalid-pch", "-include", str(header), "-c", str(source),
                                    "-o", str(work / f"{name}.pch.o")])
            with_pch.append(cpu)
            if "not used" in stderr or "invalid" in stderr:
                print(f"unit {name}: the precompiled header was not used:\n{stderr}")
        plain_total, with_total = plain_total + min(plain), with_total + min(with_pch)
        print(f"unit {name:10s} CPU {min(plain):6.1f} s plain, {min(with_pch):6.1f} s with the header", flush=True)
    print(f"all units: CPU {plain_total:.1f} s plain, {with_total:.1f} s with the header "
          f"+ {built:.1f} s to build it = {with_total + built:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cold", "units", "pch", "all"), default="cold")
    parser.add_argument("--rounds", type=int, default=1, help="compiles per unit and side in --part pch")
    args = parser.parse_args()
    print(load())
    with tempfile.TemporaryDirectory(prefix="native-build-bench-") as work:
        work = pathlib.Path(work)
        for part, run in (("cold", lambda: cold(work)), ("units", lambda: units(work)),
                          ("pch", lambda: pch(work, args.rounds))):
            if args.part in (part, "all"):
                run()
    print(load())


if __name__ == "__main__":
    main()
