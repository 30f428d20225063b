"""A SkyPilot sweep with `reuse = true` against one cluster per step, on the
Slurm test bed (tests/support/testbeds/slurm_cluster.py; as root, about 15 min).

Each variant is one serial `doit` of STEPS steps that each `sleep SECONDS`,
on a project of its own (copy transport, bubblewrap), timed from start to
exit (the last teardown included), the two variants interleaved over the
repeats:

    per-step   reuse = false: each step launches, sets up and downs a cluster
    reuse      reuse = true, max_parallel = 1: one cluster, the steps queued on it

and, for `reuse`, the time from a step's launch (its handle is written as
`doit` reaches it) to its command running on the warm cluster (the worker's
start time), median over the warm steps.

    .venv/bin/python bench/bench_reuse.py [--bed /tmp/sxt-bench-reuse] [--repeats 1] [--src DIR]

`--src DIR` runs the steps with the substrax_tasks of DIR (e.g. `git archive
main | tar -x -C DIR`): an A/B of two versions, one bench run each. Each
doit's output is kept beside the bed (`<prefix>.log`).

The bed is brought up in --bed (or the one up there is used) and taken down
at the end unless --keep-bed.
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
from typing import Any

from _common import cli_argv, doit_argv, median
from _skypilot_bed import REPO, bed_folder_ready, env_for, parse, sky_project
from testbeds.slurm_cluster import DEFAULT_SKY_VENV, SlurmBed, bed_down, bed_up

from substrax_tasks.backends.skypilot.client import SkyClient

DODO = """
from substrax_tasks import doit_config, remote_step

DOIT_CONFIG = doit_config(default_tasks=["s"])

def task_s():
    for m in range({steps}):
        yield from remote_step(f"s:m{{m}}", shell=f"sleep {seconds}; echo {{m}} > out-{{m}}.txt",
                               outputs=[f"out-{{m}}.txt"], timeout=300)
"""


def project(base: Path, bed: SlurmBed, prefix: str, reuse: bool, *, steps: int, seconds: float) -> Path:
    return sky_project(base, bed, prefix, reuse, dodo=DODO.format(steps=steps, seconds=seconds),
                       idle_minutes=2)  # fmt: skip


def timings(root: Path, env: dict[str, str]) -> tuple[list[float], list[float]]:
    """Seconds from each warm run's handle to its command's start; and from
    each run's command's end to the next run's handle (the end seen, the
    outputs fetched and promoted, and, per step, the cluster taken down)."""
    done = subprocess.run([*cli_argv(), "--project", str(root), "status", "--all", "--json"], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    runs = {r["run_id"]: r for r in json.loads(done.stdout)["runs"]}
    handles = [json.loads(p.read_text()) for p in (root / ".substrax" / "runs").glob("*/handle.json")]
    handles.sort(key=lambda h: parse(h["created_at"]))
    starts, gaps = [], []
    for handle, after in zip(handles, [*handles[1:], None], strict=True):
        run = runs.get(handle["run_id"], {})
        # queued on another run's cluster
        warm = handle["backend_state"].get("cluster") != _own_cluster(handle, root)
        if warm and run.get("started_at"):
            starts.append(parse(str(run["started_at"])) - parse(handle["created_at"]))
        if after is not None and run.get("ended_at"):
            gaps.append(parse(after["created_at"]) - parse(str(run["ended_at"])))
    return starts, gaps


def _own_cluster(handle: dict[str, Any], root: Path) -> str:
    from substrax_tasks.backends.skypilot.settings import SkypilotSettings
    from substrax_tasks.backends.skypilot.task import cluster_name
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.run_store import RunStore

    settings = SkypilotSettings.model_validate(handle["settings"])
    client_id = RunStore(root / ".substrax").client_id()
    return cluster_name(settings, RunHandle.model_validate(handle), client_id)


def run(base: Path, bed: SlurmBed, reuse: bool, *, steps: int, seconds: float, src: Path | None,
        logs: Path) -> tuple[float, list[float], list[float]]:  # fmt: skip
    prefix = f"sxb{'r' if reuse else 'p'}{secrets.token_hex(2)}"
    root = project(base, bed, prefix, reuse, steps=steps, seconds=seconds)
    env = env_for(bed, src)
    started = time.monotonic()
    said = []  # its output, each line timed: where a step's time goes
    with subprocess.Popen(doit_argv(), cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:  # fmt: skip
        for line in proc.stdout or ():
            said.append(f"{time.monotonic() - started:7.1f} {line}")
    wall = time.monotonic() - started
    (logs / f"{prefix}.log").write_text("".join(said))
    sky = SkyClient(str(bed.sky_python), env=bed.sky_env())
    left = [r["name"] for r in sky.call("cluster_status", {}) if str(r["name"]).startswith(prefix)]
    for cluster in left:  # a warm one with reuse (its lease would keep it idle_minutes), else not expected
        sky.call("down", {"cluster_name": cluster}, timeout=None)
    if proc.returncode != 0 or (left and not reuse):
        raise SystemExit(f"{prefix}: doit exit {proc.returncode}, clusters left {left}\n{''.join(said)}")
    return (wall, *timings(root, env))


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--bed", type=Path, default=Path("/tmp/sxt-bench-reuse/bed"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--keep-bed", action="store_true")
    parser.add_argument("--src", type=Path, default=None, help="run the substrax_tasks of this folder")
    parser.add_argument("--only", choices=("reuse", "per-step"), help="run one variant (an A/B of versions)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (DEFAULT_SKY_VENV / "bin" / "sky").exists():
        print("bench_reuse.py: skipped: the Slurm test bed needs root, and SkyPilot in .sky-venv")
        return 0
    bed_folder_ready(args.bed)
    bed = bed_up(args.bed, sky_venv=DEFAULT_SKY_VENV, log=lambda line: print(f"[bed] {line}", flush=True))
    walls: dict[bool, list[float]] = {False: [], True: []}
    warm: list[float] = []
    gaps: dict[bool, list[float]] = {False: [], True: []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-reuse-") as base:
            for repeat in range(args.repeats):
                order = (False, True) if repeat % 2 == 0 else (True, False)
                for reuse in [r for r in order if args.only in (None, "reuse" if r else "per-step")]:
                    wall, starts, ends = run(
                        Path(base),
                        bed,
                        reuse,
                        steps=args.steps,
                        seconds=args.seconds,
                        src=args.src,
                        logs=args.bed.parent,
                    )
                    walls[reuse].append(wall)
                    warm += starts
                    gaps[reuse] += ends
                    name = "reuse" if reuse else "per-step"
                    extra = f", warm starts {[round(s, 1) for s in starts]}" if reuse else ""
                    extra += f", end to next step {[round(s, 1) for s in ends]}"
                    print(f"repeat {repeat + 1}: {name} {wall:.1f} s{extra}", flush=True)
    finally:
        if not args.keep_bed:
            bed_down(args.bed)
    per_step, reused = median(walls[False]), median(walls[True])
    print(
        f"\n{args.src or REPO}: {args.steps} steps of sleep {args.seconds:g}, serial, "
        f"{args.repeats} repeat(s), medians"
    )
    print("| figure | value | goal |\n| --- | --- | --- |")
    print(f"| wall, one cluster per step | {per_step:.1f} s | |")
    print(f"| wall, reuse = true, max_parallel = 1 | {reused:.1f} s | |")
    print(f"| ratio reuse / per-step | {reused / per_step:.2f}x | <= 0.5x |")
    print(f"| launch to running, warm cluster (median of {len(warm)}) | {median(warm):.1f} s | <= 10 s |")
    print(f"| a command's end to the next step's launch, reuse | {median(gaps[True]):.1f} s | |")
    print(f"| a command's end to the next step's launch, per step | {median(gaps[False]):.1f} s | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
