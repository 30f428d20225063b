"""Warm SkyPilot clusters (issue 31), on the Slurm test bed
(tests/support/testbeds/slurm_cluster.py; as root, about 20 min), side by
side in one run:

    warm      `doit` started -> the command running, on a cluster a previous
              `doit` left warm (reuse = true; the first doit launched it)
    serial    4 steps of `sleep 20`, one serial `doit`, reuse = true and
              max_parallel = 1 against a cluster per step (wall clock, the
              last teardown included)
    cold      `doit` started -> the command running, on a new cluster, this
              tree against --before (e.g. `git archive main | tar -x -C DIR`)

    .venv/bin/python bench/bench_warm.py [--bed /tmp/sxt-bench-warm/bed] [--before DIR]

A step's "command running" is its worker's recorded start. Each doit's output
is kept beside the bed (`<prefix>.log`). It measures and prints; it asserts
nothing. The bed is brought up in --bed (or the one up there is used) and
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
from _skypilot_bed import REPO, env_for, parse, sky_project
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


def to_running(root: Path, env: dict[str, str], log: Path) -> float:
    """`doit` started -> its (one) step's command running."""
    began = time.time()
    doit(root, env, log)
    return latest_start(root, env) - began


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
        cold = to_running(root, env, log)
        warm = []
        for n in range(repeats):
            (root / "in.txt").write_text(f"{n + 1}\n")  # the loop users live in: edit, doit
            warm.append(to_running(root, env, log))
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


def variant_cold(base: Path, bed: SlurmBed, logs: Path, src: Path | None) -> float:
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
    parser.add_argument("--before", type=Path, default=None, help="the tree a cold step is compared with")
    parser.add_argument("--keep-bed", action="store_true")
    parser.add_argument("--only-warm", action="store_true", help="measure the warm start alone")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (DEFAULT_SKY_VENV / "bin" / "sky").exists():
        print("bench_warm.py: skipped: the Slurm test bed needs root, and SkyPilot in .sky-venv")
        return 0
    args.bed.parent.mkdir(parents=True, exist_ok=True)
    args.bed.parent.chmod(0o755)  # the cluster user lives under it
    bed = bed_up(args.bed, sky_venv=DEFAULT_SKY_VENV, log=lambda line: print(f"[bed] {line}", flush=True))
    logs = args.bed.parent
    try:
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
            base = Path(tmp)
            cold_new, warm = variant_warm(base, bed, logs, args.warm_repeats)
            print(f"warm: cold {cold_new:.1f} s, then {[round(w, 1) for w in warm]}", flush=True)
            if args.only_warm:
                print(f"| doit started -> command running, warm cluster of a previous doit (median of "
                      f"{len(warm)}) | {median(warm):.1f} s | <= 5 s |")  # fmt: skip
                return 0
            reused = variant_serial(base, bed, logs, True, steps=args.steps, seconds=args.seconds)
            print(f"serial, reuse: {reused:.1f} s", flush=True)
            per_step = variant_serial(base, bed, logs, False, steps=args.steps, seconds=args.seconds)
            print(f"serial, a cluster per step: {per_step:.1f} s", flush=True)
            cold_before = variant_cold(base, bed, logs, args.before) if args.before else None
            cold_after = variant_cold(base, bed, logs, None)
            print(f"cold: before {cold_before}, after {cold_after:.1f} s", flush=True)
    finally:
        if not args.keep_bed:
            bed_down(args.bed)
    print(f"\n{REPO}: the Slurm test bed, one run")
    print("| figure | value | goal |\n| --- | --- | --- |")
    print(f"| doit started -> command running, warm cluster of a previous doit (median of {len(warm)}) "
          f"| {median(warm):.1f} s | <= 5 s |")  # fmt: skip
    print(f"| {args.steps} x sleep {args.seconds:g} serial, reuse + max_parallel = 1 | {reused:.1f} s | |")
    print(f"| {args.steps} x sleep {args.seconds:g} serial, a cluster per step | {per_step:.1f} s | |")
    print(f"| ratio | {reused / per_step:.2f}x | <= 0.35x |")
    before = f"{cold_before:.1f} s" if cold_before is not None else "not measured (--before)"
    print(f"| cold step, doit started -> command running, before | {before} | |")
    print(f"| cold step, doit started -> command running, after | {cold_after:.1f} s | no slower |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
