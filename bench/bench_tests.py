#!/usr/bin/env python3
"""Figure of the test suite (issue 20): pytest on two xdist workers, as
`make test` runs it, against one process, on the same test files.

    .venv/bin/python bench/bench_tests.py [--repeats 3] [--workers 2] [FILE ...]
    .venv/bin/python bench/bench_tests.py --repeats 1 tests   # the whole suite, ~20 min

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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="*", default=DEFAULT_FILES, help="test files or folders")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    modes = {"serial": ["-n", "0"], "xdist": ["-n", str(args.workers), "--dist", "loadfile"]}
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
