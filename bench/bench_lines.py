#!/usr/bin/env python3
"""The size figures of issue 20: how much code there is to read.

    .venv/bin/python bench/bench_lines.py [--strict]

Counts lines as `wc -l` does (newline characters) in the package
(`find substrax_tasks -name "*.py" | xargs cat | wc -l`, goal <= 4,800), in
`remote/` (`cat remote/*.py | wc -l`, goal <= 1,400) and in each module of
both (goal: none over 400). Prints a table, the largest modules first;
`--strict` exits 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_GOAL = 4800
REMOTE_GOAL = 1400
MODULE_GOAL = 400
SHOWN = 8  # the largest modules listed


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = parser.parse_args()

    package = sorted((REPO / "substrax_tasks").rglob("*.py"))
    remote = sorted((REPO / "remote").glob("*.py"))
    sizes = {path.relative_to(REPO).as_posix(): lines(path) for path in package + remote}
    over = {name: n for name, n in sizes.items() if n > MODULE_GOAL}
    figures = [
        ("substrax_tasks/**/*.py", sum(lines(p) for p in package), f"<= {PACKAGE_GOAL:,}",
         sum(lines(p) for p in package) <= PACKAGE_GOAL),
        ("remote/*.py", sum(lines(p) for p in remote), f"<= {REMOTE_GOAL:,}",
         sum(lines(p) for p in remote) <= REMOTE_GOAL),
        (f"modules over {MODULE_GOAL} lines", len(over), "0", not over),
    ]  # fmt: skip

    print(f"{'figure':<28} {'value':>7}  {'goal':<9} met")
    for name, value, goal, met in figures:
        print(f"{name:<28} {value:>7,}  {goal:<9} {'yes' if met else 'NO'}")
    print(f"\nthe {SHOWN} largest modules:")
    for name, n in sorted(sizes.items(), key=lambda item: -item[1])[:SHOWN]:
        print(f"  {n:>5}  {name}{'  (over the goal)' if n > MODULE_GOAL else ''}")
    return 1 if args.strict and not all(met for *_, met in figures) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly, as for any Unix tool
    sys.exit(main())
