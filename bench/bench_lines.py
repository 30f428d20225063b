#!/usr/bin/env python3
"""The package's lines by concept (issue 30): how much code each word of the
design holds, and where it was before a move.

    .venv/bin/python bench/bench_lines.py [--before REV]

Counts lines as `wc -l` does (newline characters) in each concept package
of `substrax_tasks/` (its top-level folders; `backends/` split into the shared
contract and one row per backend), the leaves at its top level, and the
worker's `remote/`. With `--before REV` (a commit, e.g. the one before a move)
a second pair of columns counts that commit's files, each put under the
concept its file belongs to now: git's rename detection (`git diff -M`)
follows each file from REV to the working tree's commit; a file that was
deleted or merged away is counted under "(gone)".
It measures and prints; it asserts nothing (the old line caps are withdrawn:
a module is as large as its one concept).
"""

from __future__ import annotations

import argparse
import subprocess
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "substrax_tasks"
BACKENDS = ("local", "ssh", "skypilot")


def concept(path: str) -> str:
    """The row a file of the repository counts under."""
    parts = Path(path).parts
    if parts[0] == "remote":
        return "remote/ (the worker)"
    if len(parts) == 2:
        return "top level (leaves)"
    if parts[1] == "backends" and len(parts) > 3 and parts[2] in BACKENDS:
        return f"backends/{parts[2]}"
    return f"{parts[1]}/"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def tracked_now() -> dict[str, int]:
    files = git("ls-files", "--", PACKAGE, "remote").split()
    return {f: (REPO / f).read_bytes().count(b"\n") for f in files if f.endswith(".py")}


def tracked_at(rev: str) -> dict[str, int]:
    files = git("ls-tree", "-r", "--name-only", rev, "--", PACKAGE, "remote").split()
    return {f: git("show", f"{rev}:{f}").count("\n") for f in files if f.endswith(".py")}


def where_now(rev: str) -> dict[str, str | None]:
    """Each file of `rev` -> its path now (None: deleted)."""
    moved: dict[str, str | None] = {}
    for line in git("diff", "-M30%", "--name-status", rev, "HEAD", "--", PACKAGE, "remote").splitlines():
        status, *paths = line.split("\t")
        if status.startswith("R"):
            moved[paths[0]] = paths[1]
        elif status.startswith("D"):
            moved[paths[0]] = None
    return moved


def table(counts: dict[str, int], rows: dict[str, str | None]) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path, n in counts.items():
        now = rows.get(path, path)
        row = "(gone)" if now is None else concept(now)
        out[row][0] += 1
        out[row][1] += n
    return {row: (m, n) for row, (m, n) in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", metavar="REV", help="also count this commit, by today's concepts")
    args = parser.parse_args()
    now = table(tracked_now(), {})
    before = table(tracked_at(args.before), where_now(args.before)) if args.before else {}
    rows = sorted(set(now) | set(before), key=lambda r: (r.startswith(("top", "remote", "(")), r))
    head = f"{'concept':<26}{'modules':>9}{'lines':>8}"
    if args.before:
        head += f"{'modules':>12}{'lines':>8}   (before: {args.before})"
    print(head)
    for row in [*rows, "total"]:
        if row == "total":
            m_now, n_now = (sum(v[i] for v in now.values()) for i in (0, 1))
            m_was, n_was = (sum(v[i] for v in before.values()) for i in (0, 1))
        else:
            m_now, n_now = now.get(row, (0, 0))
            m_was, n_was = before.get(row, (0, 0))
        line = f"{row:<26}{m_now:>9}{n_now:>8}"
        if args.before:
            line += f"{m_was:>12}{n_was:>8}"
        print(line)


if __name__ == "__main__":
    main()
