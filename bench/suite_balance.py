"""Where a whole test run's time went, file by file, and what the file order does to the workers.

    SUPA_EMULATE=1 python -m pytest --junitxml=run.xml ...
    python bench/suite_balance.py run.xml [--workers 2] [--top 25] [--longest N]

Reads the JUnit XML of a run (each test's setup + call + teardown seconds) and prints:
- each file's share of the tests' time, its test count and its slowest test;
- the run as pytest-xdist's `--dist loadfile` would have played it on `--workers` workers with the
  order tests/conftest.py gives the files (LONGEST_FIRST, then the most tests first): when each
  worker ran out of work, and which file each ran last;
- the same with every file of the run in the order of its time, longest first (what LONGEST_FIRST
  approximates), and the LONGEST_FIRST list of `--longest` files that would give.

The replay hands out files as xdist's LoadScopeScheduling does (one file to each worker, another one
whenever a worker has two tests or fewer left), with each test taking what the report says. What
happens outside the tests (start-up, collection, the native build before the first test) is not in
the report: add it to the replayed end to compare with a run's wall time.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def durations(report: pathlib.Path) -> dict[str, list[tuple[str, float]]]:
    """file name -> [(test name, seconds)] in the report's order."""
    files = collections.defaultdict(list)
    for case in ET.parse(report).getroot().iter("testcase"):
        # A file skipped as a whole is reported with an empty classname and the module as its name.
        module = (case.get("classname") or case.get("name", "")).split(".")
        name = next((part for part in module if part.startswith("test_")), module[-1]) + ".py"
        files[name].append((case.get("name", ""), float(case.get("time") or 0)))
    return dict(files)


def conftest_order(files: dict) -> list[str]:
    """The files in the order tests/conftest.py sorts them (LONGEST_FIRST, then most tests first, then name)."""
    text = (TESTS / "conftest.py").read_text()
    listed = re.search(r"LONGEST_FIRST = \((.*?)\)\n", text, re.S)
    longest = re.findall(r'"([^"]+)"', listed.group(1)) if listed else []
    position = {name: index for index, name in enumerate(longest)}
    return sorted(files, key=lambda name: (position.get(name, len(position)), -len(files[name]), name))


def replay(files: dict, order: list[str], workers: int) -> list[dict]:
    """Each worker's end time and files, as xdist's loadfile scheduling would hand out `order`."""
    queue = collections.deque(order)
    state = [{"clock": 0.0, "tests": collections.deque(), "files": []} for _ in range(workers)]

    def assign(worker):
        name = queue.popleft()
        worker["files"].append(name)
        worker["tests"].extend(seconds for _, seconds in files[name])

    for worker in state:  # one file each, then a second to any worker that has two tests or fewer
        if queue:
            assign(worker)
    for worker in state:
        if queue and len(worker["tests"]) <= 2:
            assign(worker)
    while any(worker["tests"] for worker in state):
        worker = min((w for w in state if w["tests"]), key=lambda w: w["clock"] + w["tests"][0])
        worker["clock"] += worker["tests"].popleft()
        if queue and len(worker["tests"]) <= 2:
            assign(worker)
    return state


def show_replay(title: str, state: list[dict]) -> float:
    end = max(worker["clock"] for worker in state)
    print(f"\n{title}: the last worker ends at {end:.0f} s")
    for index, worker in enumerate(state):
        print(f"  worker {index}: ends at {worker['clock']:.0f} s (idle {end - worker['clock']:.0f} s), "
              f"{len(worker['files'])} files, last: {', '.join(worker['files'][-3:])}")
    return end


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=pathlib.Path, help="a --junitxml report of a run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="files to list")
    parser.add_argument("--longest", type=int, default=21, help="files in the suggested LONGEST_FIRST")
    args = parser.parse_args(argv)
    if not args.report.is_file():
        parser.error(f"{args.report}: no such report (write one with pytest --junitxml=PATH)")
    files = durations(args.report)
    total = sum(seconds for tests in files.values() for _, seconds in tests)
    print(f"{sum(map(len, files.values()))} tests in {len(files)} files, {total:.0f} s of tests' time "
          f"({total / args.workers:.0f} s a worker if shared evenly)")
    by_time = sorted(files, key=lambda name: -sum(seconds for _, seconds in files[name]))
    for name in by_time[:args.top]:
        seconds = sum(s for _, s in files[name])
        slowest = max(files[name], key=lambda test: test[1])
        print(f"  {seconds:7.1f} s {100 * seconds / total:5.1f}% {len(files[name]):4d} tests  {name}"
              f"  (slowest {slowest[1]:.1f} s: {slowest[0]})")
    show_replay("conftest.py's order", replay(files, conftest_order(files), args.workers))
    show_replay("every file longest first", replay(files, by_time, args.workers))
    print("\nLONGEST_FIRST by this report:", ", ".join(by_time[:args.longest]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
