"""A SkyPilot cluster lost mid-run and the step relaunched (issue 32), on the
Slurm test bed (tests/support/testbeds/slurm_cluster.py; as root, about
5 min a repeat):

    a step counts to --count, one count a second, writing its checkpoint by
    rename (tests/support/checkpoint_parts.py), `preemptions=1`,
    `checkpoint_seconds` = --every; --offset seconds (half of --every) after
    a snapshot of --after counts came home, the Slurm allocation that holds
    its cluster is cancelled (`scancel`), as a preemption looks there

    to running again   the allocation cancelled -> the command running on
                       the new cluster (its attempt's recorded start), with
                       the new cluster's cold launch
    redone             counts made twice: after the snapshot the second
                       attempt started from, before the allocation ended
                       (as its log, followed here, showed them)
    breakdown          from the lines doit prints, each timed as it comes:
                       detection (cancelled -> "attempt 1 lost its machine"),
                       teardown (-> "the lost cluster ... is taken down"),
                       launch (-> "attempt 2 on ... starts": the new
                       cluster's launch, its setup, the step's sync),
                       restore (-> "checkpoints put in place"), start (->
                       the command's "start N" line back here)

    .venv/bin/python bench/bench_preemption.py [--bed /tmp/sxt-bench-preempt/bed] [--repeats 1]

It measures and prints; it asserts nothing but that the step finished.
Each doit's output, each line timed, is kept beside the bed
(`<prefix>.log`). The bed is brought up in --bed (or the one up there is
used) and taken down at the end unless --keep-bed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import doit_argv, median
from _skypilot_bed import REPO, bed_folder_ready, env_for, parse, sky_project
from checkpoint_parts import COUNT_PY, count_step, counts, kept_state, starts
from testbeds.slurm_cluster import DEFAULT_SKY_VENV, SlurmBed, bed_down, bed_up, load_bed

from substrax_tasks.backends.skypilot.client import SkyClient

PHASES = (  # (name, the line that ends it)
    ("detection", "attempt 1 lost its machine"),
    ("teardown", "is taken down"),
    ("launch", "attempt 2 on "),
    ("restore", "checkpoints put in place"),
)


class TimedOutput:
    """A doit's output, each line stamped (time.time()) as it arrives."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.reader.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        for line in proc.stdout or ():
            self.lines.append((time.time(), line))

    def first(self, text: str, after: float) -> float | None:
        return next((at for at, line in self.lines if at >= after and text in line), None)


def allocation_of(bed: SlurmBed, cluster: str) -> str | None:
    """The Slurm job holding the cluster (SkyPilot names it `<cluster>-<user hash>`)."""
    listed = subprocess.run(["squeue", "-h", f"--user={bed.user}", "-o", "%i|%j"], env=bed.slurm_env(),
                            capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
    jobs = (line.split("|", 1) for line in listed.split())
    return next((i for i, name in jobs if name.startswith(f"{cluster}-")), None)


def down_all(bed: SlurmBed, prefix: str) -> None:
    sky = SkyClient(str(bed.sky_python), env=bed.sky_env())
    for record in sky.call("cluster_status", {}):
        if str(record["name"]).startswith(prefix):
            sky.call("down", {"cluster_name": record["name"]}, timeout=None)


def one_preemption(base: Path, bed: SlurmBed, logs: Path, *, count: int, every: float, after: int,
                   offset: float) -> dict[str, float]:  # fmt: skip
    prefix = f"sxbp{secrets.token_hex(2)}"
    dodo = ("from substrax_tasks import doit_config, remote_step\n\n"
            'DOIT_CONFIG = doit_config(default_tasks=["count"])\n\ndef task_all():\n'
            + count_step("count", count, 1.0, preemptions=1, timeout=1800))  # fmt: skip
    root = sky_project(base, bed, prefix, False, dodo=dodo, idle_minutes=3,
                       files={"count.py": COUNT_PY, "data.txt": "one\n"})  # fmt: skip
    table = "[tool.substrax.compute.backends.skypilot]\n"
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(table, f"{table}checkpoint_seconds = {every}\n"))
    env = env_for(bed, None)
    env["PYTHONUNBUFFERED"] = "1"
    try:
        began = time.time()
        proc = subprocess.Popen(doit_argv(), cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
        out = TimedOutput(proc)
        while (kept_state(root, "count") or {}).get("i", 0) < after:
            if proc.poll() is not None:
                raise SystemExit(f"{prefix}: doit ended before a snapshot of {after} counts came home")
            time.sleep(0.2)
        time.sleep(offset)  # into the interval between snapshots, as a preemption comes at any time
        handle = json.loads(next((root / ".substrax" / "runs").glob("*/handle.json")).read_text())
        job = allocation_of(bed, handle["backend_state"]["cluster"])
        if job is None:
            raise SystemExit(f"{prefix}: no Slurm job holds {handle['backend_state']['cluster']}")
        subprocess.run(["scancel", job], env=bed.slurm_env(), capture_output=True, timeout=60, check=True)
        cancelled = time.time()
        code = proc.wait()
        out.reader.join(timeout=30)
    finally:
        down_all(bed, prefix)
    with (logs / f"{prefix}.log").open("w") as f:
        f.write("".join(f"{at - began:8.1f} {line}" for at, line in out.lines))
    said = "".join(line for _, line in out.lines)
    if code != 0:
        raise SystemExit(f"{prefix}: doit exit {code}\n{said[-3000:]}")
    handle = json.loads(next((root / ".substrax" / "runs").glob("*/handle.json")).read_text())
    second = handle["state"]["attempts"][1]
    # The counts the first attempt was seen to make (its log followed here until the allocation
    # ended): those past the snapshot the second started from were made twice.
    second_start = [m.start() for m in re.finditer(r"^start \d+$", said, re.M)][1]
    at_loss = max(counts(said[:second_start]))
    resumed = starts(said)[1]
    figures = {"to running again": parse(second["started_at"]) - cancelled,
               "redone": float(at_loss - resumed), "counts before the loss": float(at_loss),
               "started from": float(resumed)}  # fmt: skip
    last = cancelled
    for name, text in PHASES:
        at = out.first(text, last)
        figures[name] = (at - last) if at is not None else float("nan")
        last = at if at is not None else last
    back = out.first(f"start {resumed}", last)
    figures["start"] = (back - last) if back is not None else float("nan")
    figures["line 'start N' back here"] = (back - cancelled) if back is not None else float("nan")
    print(f"{prefix}: {json.dumps({k: round(v, 1) for k, v in figures.items()})}", flush=True)
    return figures


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--bed", type=Path, default=Path("/tmp/sxt-bench-preempt/bed"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--count", type=int, default=40, help="the step counts to this, one a second")
    parser.add_argument("--every", type=float, default=5.0, help="checkpoint_seconds")
    parser.add_argument("--after", type=int, default=8, help="the loss comes once a snapshot has this many")
    parser.add_argument("--offset", type=float, default=None,
                        help="and this many seconds after that snapshot came home (default: --every / 2)")
    parser.add_argument("--keep-bed", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (DEFAULT_SKY_VENV / "bin" / "sky").exists():
        print("bench_preemption.py: skipped: the Slurm test bed needs root, and SkyPilot in .sky-venv")
        return 0
    if load_bed(args.bed) is None:  # a new bed, in a folder of its own: the cluster user lives under it
        bed_folder_ready(args.bed)
    bed = bed_up(args.bed, sky_venv=DEFAULT_SKY_VENV, log=lambda line: print(f"[bed] {line}", flush=True))
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp:
            for _ in range(args.repeats):
                offset = args.every / 2 if args.offset is None else args.offset
                runs.append(one_preemption(Path(tmp), bed, args.bed.parent, count=args.count,
                                           every=args.every, after=args.after, offset=offset))  # fmt: skip
    finally:
        if not args.keep_bed:
            bed_down(args.bed)
    load = os.getloadavg()[0]
    print(f"\n{REPO}: the Slurm test bed, {len(runs)} run(s), load {load:.1f}; checkpoint_seconds = "
          f"{args.every:g}, one count a second")  # fmt: skip
    print("| figure | value |\n| --- | --- |")
    for name in ("to running again", "redone", *(n for n, _ in PHASES), "start"):
        unit = " counts" if name == "redone" else " s"
        values = [r[name] for r in runs]
        shown = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {median(values):.1f}{unit}" + (f" ({shown})" if len(values) > 1 else "") + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
