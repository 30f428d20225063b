"""Warm SkyPilot clusters (issue 31), on the Slurm test bed
(tests/support/testbeds/slurm_cluster.py; as root, about 20 min), side by
side in one run:

    warm      `doit` started -> the command running, on a cluster a previous
              `doit` left warm (reuse = true; the first doit launched it)
    serial    4 steps of `sleep 20`, one serial `doit`, reuse = true and
              max_parallel = 1 against a cluster per step (wall clock, the
              last teardown included)
    cold      `doit` started -> the command running, on a new cluster, this
              tree against each --before (e.g. `git archive main | tar -x -C
              DIR`), --cold-samples of each, interleaved (before, after,
              before, after, ...), medians

    .venv/bin/python bench/bench_warm.py [--bed /tmp/sxt-bench-warm/bed] [--before DIR ...]

The serial ratio is judged against the bed's floor, from the same run: with
a cold launch C (the cold step's median, this tree), the rest of a
cluster-per-step doit after its command D (fetch, verify, the cluster taken
down) and a warm start w, the reuse run is about C + N*S + (N-1)*w and the
cluster-per-step run N*(C + S + D), so no warm start can take the ratio
below (C + N*S) / (N*(C + S + D)).

A step's "command running" is its worker's recorded start. Each doit's output
is kept beside the bed (`<prefix>.log`). It measures and prints; it asserts
nothing. The machine's load (uptime) is printed at the start and the end.
The bed is brought up in --bed (or the one up there is used) and
taken down at the end unless --keep-bed; every cluster a variant leaves (a
warm one, on purpose) is taken down before the next.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import cli_argv, doit_argv, median
from _skypilot_bed import REPO, bed_folder_ready, env_for, parse, sky_project
from testbeds.slurm_cluster import DEFAULT_SKY_VENV, SlurmBed, bed_down, bed_up

from substrax_tasks.backends.skypilot.client import SkyClient

DODO = """
from substrax_tasks import doit_config, remote_step

DOIT_CONFIG = doit_config(default_tasks=["s"])

def task_s():
    for m in range({steps}):
        yield from remote_step(f"s:m{{m}}", shell=f"sleep {seconds}; cat in.txt > out-{{m}}.txt",
                               inputs=["in.txt"], outputs=[f"out-{{m}}.txt"], timeout=300)
"""


def project(base: Path, bed: SlurmBed, prefix: str, reuse: bool, *, steps: int, seconds: float) -> Path:
    return sky_project(base, bed, prefix, reuse, dodo=DODO.format(steps=steps, seconds=seconds),
                       idle_minutes=3, files={"in.txt": "0\n"})  # fmt: skip


def doit(root: Path, env: dict[str, str], log: Path) -> float:
    """One `doit` in `root`; its wall clock. Its output, each line timed, goes to `log`."""
    started = time.monotonic()
    said = []
    with subprocess.Popen(doit_argv(), cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:  # fmt: skip
        for line in proc.stdout or ():
            said.append(f"{time.monotonic() - started:7.1f} {line}")
    with log.open("a") as f:
        f.write("".join(said))
    if proc.returncode != 0:
        raise SystemExit(f"{root.name}: doit exit {proc.returncode}\n{''.join(said)}")
    return time.monotonic() - started


def latest_start(root: Path, env: dict[str, str]) -> float:
    """When the latest run's command started (its worker's record), as epoch seconds."""
    done = subprocess.run([*cli_argv(), "--project", str(root), "status", "--all", "--json"], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    runs = [r for r in json.loads(done.stdout)["runs"] if r.get("started_at")]
    return max(parse(str(r["started_at"])) for r in runs)


def to_running(root: Path, env: dict[str, str], log: Path) -> tuple[float, float]:
    """`doit` started -> its (one) step's command running; and the rest of that doit after it."""
    began = time.time()
    wall = doit(root, env, log)
    running = latest_start(root, env) - began
    return running, wall - running


def down_all(bed: SlurmBed, prefix: str) -> list[str]:
    sky = SkyClient(str(bed.sky_python), env=bed.sky_env())
    left = [r["name"] for r in sky.call("cluster_status", {}) if str(r["name"]).startswith(prefix)]
    for cluster in left:
        sky.call("down", {"cluster_name": cluster}, timeout=None)
    return left


def variant_warm(base: Path, bed: SlurmBed, logs: Path, repeats: int) -> tuple[float, list[float]]:
    """A cold doit, then `repeats` doits each after an edit, on the cluster it left warm."""
    prefix = f"sxbw{secrets.token_hex(2)}"
    root = project(base, bed, prefix, True, steps=1, seconds=0)
    env, log = env_for(bed, None), logs / f"{prefix}.log"
    try:
        cold, _ = to_running(root, env, log)
        warm = []
        for n in range(repeats):
            (root / "in.txt").write_text(f"{n + 1}\n")  # the loop users live in: edit, doit
            warm.append(to_running(root, env, log)[0])
    finally:
        down_all(bed, prefix)
    return cold, warm


def variant_serial(
    base: Path, bed: SlurmBed, logs: Path, reuse: bool, *, steps: int, seconds: float
) -> float:
    prefix = f"sxb{'r' if reuse else 'p'}{secrets.token_hex(2)}"
    root = project(base, bed, prefix, reuse, steps=steps, seconds=seconds)
    try:
        return doit(root, env_for(bed, None), logs / f"{prefix}.log")
    finally:
        left = down_all(bed, prefix)
        if left and not reuse:
            print(f"{prefix}: clusters left by a cluster-per-step doit: {left}", flush=True)


def variant_cold(base: Path, bed: SlurmBed, logs: Path, src: Path | None) -> tuple[float, float]:
    """A cold step's doit: started -> command running, and the rest after (D: fetch, verify, down)."""
    prefix = f"sxbc{secrets.token_hex(2)}"
    root = project(base, bed, prefix, False, steps=1, seconds=0)
    try:
        return to_running(root, env_for(bed, src), logs / f"{prefix}.log")
    finally:
        down_all(bed, prefix)


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--bed", type=Path, default=Path("/tmp/sxt-bench-warm/bed"))
    parser.add_argument("--warm-repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--before", type=Path, action="append", default=[],
                        help="a tree a cold step is compared with (repeatable)")
    parser.add_argument("--cold-samples", type=int, default=3, help="cold doits of each tree, interleaved")
    parser.add_argument("--keep-bed", action="store_true")
    parser.add_argument("--only-warm", action="store_true", help="measure the warm start alone")
    parser.add_argument("--only-cold", action="store_true", help="measure the cold steps alone")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (DEFAULT_SKY_VENV / "bin" / "sky").exists():
        print("bench_warm.py: skipped: the Slurm test bed needs root, and SkyPilot in .sky-venv")
        return 0
    bed_folder_ready(args.bed)
    print(f"load at the start: {load()}", flush=True)
    bed = bed_up(args.bed, sky_venv=DEFAULT_SKY_VENV, log=lambda line: print(f"[bed] {line}", flush=True))
    logs = args.bed.parent
    try:
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
            base = Path(tmp)
            warm: list[float] = []
            if not args.only_cold:
                cold_new, warm = variant_warm(base, bed, logs, args.warm_repeats)
                print(f"warm: cold {cold_new:.1f} s, then {[round(w, 1) for w in warm]}", flush=True)
            if args.only_warm:
                print(f"| doit started -> command running, warm cluster of a previous doit (median of "
                      f"{len(warm)}) | {median(warm):.1f} s | <= 5 s |")  # fmt: skip
                return 0
            if not args.only_cold:
                reused = variant_serial(base, bed, logs, True, steps=args.steps, seconds=args.seconds)
                print(f"serial, reuse: {reused:.1f} s", flush=True)
                per_step = variant_serial(base, bed, logs, False, steps=args.steps, seconds=args.seconds)
                print(f"serial, a cluster per step: {per_step:.1f} s", flush=True)
            trees: list[tuple[str, Path | None]] = [(f"before {d.name}", d) for d in args.before]
            trees.append(("after", None))
            cold: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in trees}
            for n in range(args.cold_samples):  # interleaved: the bed's load drifts alike for each
                for label, src in trees:
                    cold[label].append(variant_cold(base, bed, logs, src))
                    print(f"cold {label} #{n + 1}: {cold[label][-1][0]:.1f} s to running, then "
                          f"{cold[label][-1][1]:.1f} s", flush=True)  # fmt: skip
    finally:
        if not args.keep_bed:
            bed_down(args.bed)
    print(f"load at the end: {load()}")
    print(f"\n{REPO}: the Slurm test bed, one run")
    print("| figure | value | goal |\n| --- | --- | --- |")
    for label, samples in cold.items():
        goal = "no slower" if label == "after" else ""
        each = ", ".join(f"{r:.1f}" for r, _ in samples)
        print(f"| cold step, doit started -> command running, {label} (median of {len(samples)}: {each}) "
              f"| {median([r for r, _ in samples]):.1f} s | {goal} |")  # fmt: skip
    if args.only_cold:
        return 0
    print(f"| doit started -> command running, warm cluster of a previous doit (median of {len(warm)}) "
          f"| {median(warm):.1f} s | <= 5 s |")  # fmt: skip
    n, seconds = args.steps, args.seconds
    print(f"| {n} x sleep {seconds:g} serial, reuse + max_parallel = 1 | {reused:.1f} s | |")
    print(f"| {n} x sleep {seconds:g} serial, a cluster per step | {per_step:.1f} s | |")
    print(f"| ratio | {reused / per_step:.2f}x | <= 0.35x |")
    c, d, w = median([r for r, _ in cold["after"]]), median([t for _, t in cold["after"]]), median(warm)
    floor = (c + n * seconds) / (n * (c + seconds + d))
    expected = (c + n * seconds + (n - 1) * w) / (n * (c + seconds + d))
    print(f"| the bed's C (cold launch), D (after the command: fetch, verify, down), w (warm start) | "
          f"C = {c:.1f} s, D = {d:.1f} s, w = {w:.1f} s | |")
    print(f"| the ratio's floor on this bed, (C + {n}S) / ({n}(C + S + D)) | {floor:.2f}x | |")
    print(f"| the ratio expected from C, D, w: (C + {n}S + {n - 1}w) / ({n}(C + S + D)) "
          f"| {expected:.2f}x | |")  # fmt: skip
    return 0


def load() -> str:
    """The load averages over 1, 5 and 15 minutes, as uptime says them."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    sys.exit(main())
