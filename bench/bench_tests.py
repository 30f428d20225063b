#!/usr/bin/env python3
"""Figure of the test suite (issue 20): pytest on two xdist workers, as
`make test` runs it, against one process, on the same test files.

    .venv/bin/python bench/bench_tests.py [--repeats 3] [--workers 2] [FILE ...]
    .venv/bin/python bench/bench_tests.py --repeats 1 tests   # the whole suite, ~20 min
    .venv/bin/python bench/bench_tests.py --file-seconds JUNIT_XML  # tests/file_seconds.txt from a run

`--file-seconds` measures nothing: it sums the seconds of each test file in
the JUnit XML of a whole run (`pytest --junitxml=...`: set-up, call and
teardown of each test) and writes them to tests/file_seconds.txt, the order
`make test` runs the files in (longest first: tests/support/file_order.py).

It measures and prints; it asserts nothing but that every run passes. Each
repeat runs both, in alternating order (serial first, then xdist first), so
a load that changes over the minutes shifts both; the figure is the ratio of
the medians. The load average is printed with each run: on a machine whose
other work keeps both cores busy, a second worker has no core to run on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parent.parent
# About 100 s in one process on a quiet 2-core machine: a doit-heavy module,
# the worker's process trees, the up-to-date explanations, the run cache.
DEFAULT_FILES = [
    "tests/integration/chain/test_why.py",
    "tests/integration/local/test_worker.py",
    "tests/integration/cache/test_cache.py",
    "tests/integration/chain/test_proofs.py",
]


def run(files: list[str], extra: list[str]) -> float:
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--ignore=tests/e2e", *extra]
    argv += files
    began = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    took = time.monotonic() - began
    if done.returncode != 0:
        sys.exit(f"pytest failed ({' '.join(extra)}):\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    return took


def file_seconds(junit_xml: Path) -> dict[str, float]:
    """{test file: seconds} from a JUnit XML report; a test's classname is
    its module's dotted path, with its class (if any) after it."""
    seconds: dict[str, float] = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        for end in range(len(parts), 0, -1):
            name = "/".join(parts[:end]) + ".py"
            if (REPO / name).is_file():
                seconds[name] = seconds.get(name, 0.0) + float(case.get("time", "0"))
                break
    return seconds


def test_counts(junit_xml: Path) -> dict[str, int]:
    """{test file: number of tests} from the same report."""
    counts: dict[str, int] = {}
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        for end in range(len(parts), 0, -1):
            name = "/".join(parts[:end]) + ".py"
            if (REPO / name).is_file():
                counts[name] = counts.get(name, 0) + 1
                break
    return counts


def two_worker_end(order: list[str], seconds: dict[str, float], workers: int) -> float:
    """When the last worker is done if each takes the next file of `order`
    as soon as it is free (xdist's loadfile, less its look-ahead of 2 tests)."""
    free_at = [0.0] * workers
    for name in order:
        first_free = free_at.index(min(free_at))
        free_at[first_free] += seconds[name]
    return max(free_at)


def write_file_seconds(junit_xml: Path, workers: int) -> None:
    seconds = file_seconds(junit_xml)
    counts = test_counts(junit_xml)
    most_tests_first = sorted(seconds, key=lambda name: (-counts[name], name))  # xdist: --loadscope-reorder
    longest_first = sorted(seconds, key=lambda name: -seconds[name])
    floor = max(sum(seconds.values()) / workers, *seconds.values())
    print(f"{workers} workers, the files' measured seconds, each file taken whole when a worker is free:")
    for label, order in (("most tests first (xdist's default)", most_tests_first),
                         ("longest first (file_order.py)", longest_first)):  # fmt: skip
        print(f"  {label:36} the last worker ends at {two_worker_end(order, seconds, workers):6.0f} s")
    print(f"  {'floor (all / workers, longest file)':36} {floor:6.0f} s")
    lines = [f"{value:8.1f} {name}" for name, value in sorted(seconds.items(), key=lambda pair: -pair[1])]
    header = [
        "# Seconds of each test file in one whole run (set-up, call and teardown of its tests),",
        "# longest first: the order `make test` runs them in (tests/support/file_order.py).",
        f"# bench/bench_tests.py --file-seconds wrote it: {len(lines)} files, {sum(seconds.values()):.0f} s.",
    ]
    (REPO / "tests" / "file_seconds.txt").write_text("\n".join(header + lines) + "\n")
    print(f"tests/file_seconds.txt: {len(lines)} files, {sum(seconds.values()):.0f} s in all")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES, help="test files or folders")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--file-seconds", type=Path, metavar="JUNIT_XML",
                        help="write tests/file_seconds.txt from a JUnit report of a whole run")  # fmt: skip
    args = parser.parse_args()
    if args.file_seconds is not None:
        write_file_seconds(args.file_seconds, args.workers)
        return 0
    modes = {
        "serial": ["-n", "0"],
        "xdist": ["-n", str(args.workers), "--dist", "loadfile", "--no-loadscope-reorder"],
    }
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    print(f"{os.cpu_count()} CPUs; {' '.join(args.files)}")
    for repeat in range(args.repeats):
        order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
        for mode in order:
            load = os.getloadavg()[0]
            took = run(args.files, modes[mode])
            walls[mode].append(took)
            after = os.getloadavg()[0]
            print(f"  {mode:6} {took:7.1f} s   load average {load:.1f} -> {after:.1f}", flush=True)
    serial, xdist = statistics.median(walls["serial"]), statistics.median(walls["xdist"])
    print(f"median: serial {serial:.1f} s, xdist -n {args.workers} {xdist:.1f} s: {xdist / serial:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
