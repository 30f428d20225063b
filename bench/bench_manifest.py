"""Manifest figures: no-op verification and hashing throughput.

    .venv/bin/python bench/bench_manifest.py [--files 20000] [--big-mib 1024] [--repeats 15]

Files are written to tmpfs (/dev/shm, else the temp folder) and removed at the
end. Each figure is a ratio of two measurements taken side by side in this
one run (interleaved, median over repeats), so machine noise hits both:

(a) no-op verification: `outputs_match` of N x 4 KiB output files with a warm
    cache, vs a stat-only `os.scandir` walk of the same files (goal <= 1.3x).
    Also shown: the same check when the tree's stamp is not usable, so the
    manifest is rebuilt from cached hashes (`verify_outputs`' path), and the
    cold manifest that hashes every file.
(b) hashing: the manifest of one 1 GiB file vs `hashlib.file_digest` sha256
    of it (goal >= 0.9x the throughput).

It prints a table and says whether the goals were met; with --strict a
missed goal makes the exit status 1 (by default it only measures, like the
other benches, since a busy machine can push a ratio past its goal).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from substrax_tasks.uptodate.manifests import (
    HashCache,
    build_manifest,
    manifest_module,
    outputs_match,
)

GOAL_NOOP = 1.3  # at most this many times a stat-only walk
GOAL_HASH = 0.9  # at least this share of hashlib.file_digest's throughput


def scratch_root() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="bench-manifest-", dir=shm if shm.is_dir() else None))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each run of each function, run in turns (after one warm-up each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    return times


Row = tuple[str, float, float, float, str]  # figure, ours (s), baseline (s), ratio, goal


def row(name: str, ours: list[float], baseline: list[float], goal: str) -> Row:
    """Medians of both, and the median of the ratios of runs taken side by side
    (steadier than a ratio of medians when the machine is noisy)."""
    if len(ours) == 1:
        ratio = ours[0] / statistics.median(baseline)
    else:
        ratio = statistics.median(a / b for a, b in zip(ours, baseline, strict=True))
    return (name, statistics.median(ours), statistics.median(baseline), ratio, goal)


def stat_walk(top: Path) -> int:
    """The baseline: one lstat per entry, nothing else."""
    n = 0
    stack = [str(top)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                entry.stat(follow_symlinks=False)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                n += 1
    return n


def make_small_files(base: Path, count: int) -> None:
    data = os.urandom(4096)
    per_dir = 200
    for i in range(count):
        folder = base / "out" / f"d{i // per_dir:04d}"
        if i % per_dir == 0:
            folder.mkdir(parents=True)
        (folder / f"f{i:06d}.bin").write_bytes(data[i % 64 :] + data[: i % 64])


def make_big_file(path: Path, mib: int) -> None:
    block = os.urandom(64 << 20)
    with path.open("wb") as f:
        left = mib << 20
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n


def bench_noop(base: Path, count: int, repeats: int) -> list[Row]:
    make_small_files(base, count)
    outputs = ["out/"]
    cache_file = base / "state" / "hashes.json"
    # A file younger than RACY_SECONDS is hashed but not cached (a later
    # write could hide inside its timestamps): let the tree age first.
    time.sleep(manifest_module().RACY_SECONDS + 0.2)
    t_cold = timed(lambda: build_manifest(base, outputs))
    digest = build_manifest(base, outputs)["digest"]
    assert outputs_match(base, outputs, digest, cache_file)
    entries = stat_walk(base / "out")

    def slow_path() -> None:  # rebuild from cached hashes
        cache = HashCache.load(cache_file)
        assert build_manifest(base, outputs, cache.entries)["digest"] == digest

    def noop() -> None:
        assert outputs_match(base, outputs, digest, cache_file)

    ts = side_by_side({"noop": noop, "walk": lambda: stat_walk(base / "out"), "slow": slow_path}, repeats)
    label = f"{count:,} x 4 KiB files ({entries:,} entries)"
    return [
        row(f"no-op outputs_match, {label}", ts["noop"], ts["walk"], f"<= {GOAL_NOOP}x"),
        row("  same, stamp unusable: manifest from cached hashes", ts["slow"], ts["walk"], "(info)"),
        row("  same, cold: hash every file (one run)", [t_cold], ts["walk"], "(info)"),
    ]


def bench_hash(base: Path, mib: int, repeats: int) -> Row:
    # the reference exists from Python 3.11 on (mypy checks this file as 3.10)
    file_digest: Callable[..., Any] | None = getattr(hashlib, "file_digest", None)
    if file_digest is None:
        raise SystemExit("the hashing figure needs hashlib.file_digest (Python 3.11+)")
    big = base / "big.bin"
    make_big_file(big, mib)

    def reference() -> None:
        with big.open("rb") as f:
            file_digest(f, "sha256")

    def ours() -> None:
        build_manifest(base, ["big.bin"])

    with big.open("rb") as f:
        want = file_digest(f, "sha256").hexdigest()
    assert build_manifest(base, ["big.bin"])["entries"][0]["sha256"] == want
    ts = side_by_side({"ours": ours, "reference": reference}, repeats)
    big.unlink()
    # a throughput ratio: the reference's time over ours
    return row(f"manifest sha256 of a {mib} MiB file (throughput)", ts["reference"], ts["ours"], "")


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms" if seconds < 10 else f"{seconds:8.2f} s "


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=20_000, help="small output files (default 20000)")
    parser.add_argument("--big-mib", type=int, default=1024, help="big file size in MiB (default 1024)")
    parser.add_argument("--repeats", type=int, default=15, help="repeats of the no-op figure (default 15)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--hash-repeats", type=int, default=7, help="repeats of the hash figure (default 7)")
    args = parser.parse_args()

    root = scratch_root()
    try:
        print(
            f"python {platform.python_version()} on {platform.machine()}, "
            f"{os.cpu_count()} CPUs; files in {root}"
        )
        noop_rows = bench_noop(root / "small", args.files, args.repeats)
        hash_row = bench_hash(root, args.big_mib, args.hash_repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print()
    print(f"{'figure':<58} {'substrax':>11} {'baseline':>11} {'ratio':>7}  goal")
    for name, ours, base, ratio, goal in noop_rows:
        print(f"{name:<58} {fmt_time(ours)} {fmt_time(base)} {ratio:6.2f}x  {goal}")
    print("  (baseline: a stat-only os.scandir walk of the same tree)")
    name, reference, ours, throughput, _ = hash_row
    size = args.big_mib << 20
    print(
        f"{name:<58} {size / ours / 1e9:6.2f} GB/s {size / reference / 1e9:6.2f} GB/s"
        f"{throughput:6.2f}x  >= {GOAL_HASH}x"
    )
    print("  (baseline: hashlib.file_digest(f, 'sha256'))")
    print("  (ratios: median over runs of the ratio of two runs taken side by side)")
    print()
    ok = noop_rows[0][3] <= GOAL_NOOP and throughput >= GOAL_HASH
    print("all goals met" if ok else "GOAL MISSED (see the table)")
    return 0 if ok or not args.strict else 1


if __name__ == "__main__":
    sys.exit(main())
