#!/usr/bin/env python3
"""One verification of a fetch (issue 30): a fresh 1 GiB local output,
verified once as it is fetched against twice (fetch, then promotion).

    .venv/bin/python bench/bench_fetch_once.py --baseline DIR [--size-mib N] [--repeats N]

DIR is a checkout of the code before the change (for example `git worktree
add --detach /tmp/old COMMIT`); its `substrax_tasks` is put first on
PYTHONPATH of the baseline's `doit`, so both run with this venv's doit and
Python. Each repeat runs `doit` once per side, from a clean project (no
store, no output), alternating which side goes first; the figure is the
median wall time of the whole chain (the command writes N MiB of zeros with
`head -c`, under bubblewrap) and of what follows the run's end (from its
final status.json being written to doit's exit: fetch, verify, promote).
It measures and prints; it asserts nothing. Projects live under /dev/shm
when present and are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from _common import doit_argv, fmt_s, load_average, median, scratch_parent

PYPROJECT = """\
[tool.substrax.compute.backends.local]
sandbox = "bwrap"
[tool.substrax.compute.cache]
enabled = false
"""

DODO = """\
from substrax_tasks import doit_config, remote_step

DOIT_CONFIG = doit_config(default_tasks=["big"])


def task_big():
    yield from remote_step("big", shell="head -c {size} /dev/zero > big.bin", outputs=["big.bin"])
"""


def make_project(parent: Path, name: str, size: int) -> Path:
    root = parent / name
    root.mkdir()
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "dodo.py").write_text(DODO.format(size=size))
    return root


def clean(root: Path) -> None:
    for name in (".substrax", "big.bin", ".doit.db", ".doit.db.sqlite3"):
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def one_doit(root: Path, pythonpath: str | None) -> tuple[float, float]:
    """Wall time of `doit` from a clean project, and of what follows the
    run's end (the worker's final status written): fetch, verify, promote."""
    clean(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SUBSTRAX_", "DOIT_"))}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    started = time.time()
    done = subprocess.run(doit_argv(), cwd=root, env=env, capture_output=True, text=True, check=False)
    ended = time.time()
    if done.returncode != 0:
        sys.exit(f"doit failed in {root}:\n{done.stdout}\n{done.stderr}")
    (status,) = root.glob(".substrax/runs/*/status.json")
    return ended - started, ended - status.stat().st_mtime


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--baseline", required=True, help="a checkout of the code before the change")
    parser.add_argument("--size-mib", type=int, default=1024, help="the output's size (default 1024)")
    parser.add_argument("--repeats", type=int, default=5, help="doit runs per side (default 5)")
    args = parser.parse_args(argv)
    baseline = str(Path(args.baseline).resolve())
    if not (Path(baseline) / "substrax_tasks").is_dir():
        parser.error(f"{baseline} holds no substrax_tasks/: give a checkout of the project")
    size = args.size_mib << 20
    sides = {"before": baseline, "after": None}
    totals: dict[str, list[float]] = {side: [] for side in sides}
    tails: dict[str, list[float]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench-fetch-", dir=scratch_parent()) as scratch:
        roots = {side: make_project(Path(scratch), side, size) for side in sides}
        one_doit(roots["after"], None)  # warm: the page cache, the worker's first start
        for i in range(args.repeats):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))
            for side in order:
                total, tail = one_doit(roots[side], sides[side])
                totals[side].append(total)
                tails[side].append(tail)
            clean(roots["before"])
            clean(roots["after"])
    print(f"fresh {args.size_mib} MiB local output (bubblewrap), {args.repeats} doit runs per side, "
          f"interleaved; {load_average()}")  # fmt: skip
    print(f"{'side':8} {'doit, s (median)':>17} {'after the run ended, s (median)':>33}")
    for side in sides:
        print(f"{side:8} {fmt_s(median(totals[side])):>17} {fmt_s(median(tails[side])):>33}")
    saved = median(tails["before"]) - median(tails["after"])
    per_gib = saved / (args.size_mib / 1024)
    print(f"saved after the run ended: {fmt_s(saved)} s per doit ({per_gib:.2f} s per GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
