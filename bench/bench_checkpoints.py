#!/usr/bin/env python3
"""The overhead of checkpoints on a run that is never preempted (issue 32):
a step that writes a SIZE checkpoint (by rename, as `torch.save` to a
temporary name then `os.replace`) every `checkpoint_seconds` for SECONDS,
with `checkpoints="ckpt/"` (its snapshots brought home every
`checkpoint_seconds`) against the same step without (it writes the same
file to its private tmp), side by side in one `doit -n 2 -P thread`:

    .venv/bin/python bench/bench_checkpoints.py --bed ssh    # the namespace sshd host: quick
    .venv/bin/python bench/bench_checkpoints.py --bed slurm  # SkyPilot on the Slurm bed (root, ~20 min)

For each step: its wall clock (`launch` started -> promoted, from the
phase times its handle records) and its run phase; the ratio of the two
wall clocks; and the breakdown of the snapshots: how many were pulled,
the bytes they copied and the time they took (the client's "checkpoints
brought home" lines). It measures and prints; it asserts nothing. On the
ssh bed the host is the test bed's throwaway sshd in a network namespace
(tests/support/testbeds/sshd_host.py), its folders and the project on
tmpfs (/dev/shm) when there is one; on the Slurm bed (bench_warm.py's),
each step has a cluster of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from _common import doit_argv, median, scratch_parent
from _skypilot_bed import REPO, bed_folder_ready, env_for, parse, sky_project
from testbeds.sshd_host import start_host, stop_host

# argv: DIR ("-": the private tmp), SECONDS, SIZE_MIB, EVERY. Each
# generation's bytes differ, so no copy can be skipped as unchanged.
WRITER_PY = """\
import os, sys, tempfile, time
folder = tempfile.gettempdir() if sys.argv[1] == "-" else sys.argv[1]
seconds, size, every = float(sys.argv[2]), int(sys.argv[3]) << 20, float(sys.argv[4])
os.makedirs(folder, exist_ok=True)
chunk = 8 << 20
began, generation = time.monotonic(), 0
while time.monotonic() - began < seconds:
    generation += 1
    block = bytes([generation % 251]) * chunk
    with open(os.path.join(folder, "model.pt.tmp"), "wb") as f:
        for _ in range(size // chunk):
            f.write(block)
    os.replace(os.path.join(folder, "model.pt.tmp"), os.path.join(folder, "model.pt"))
    print("checkpoint", generation, flush=True)
    time.sleep(max(0.0, every - (time.monotonic() - began) % every))
open(sys.argv[5], "w").write("%d\\n" % generation)
"""

DODO = """
from substrax_tasks import doit_config, remote_step

DOIT_CONFIG = doit_config(default_tasks=["with", "without"])

def task_with():
    yield from remote_step("with", command=["python3", "writer.py", "ckpt", "{seconds}", "{size}", "{every}",
                           "with.txt"], inputs=["writer.py"], outputs=["with.txt"], timeout=3600,
                           checkpoints="ckpt/")

def task_without():
    yield from remote_step("without", command=["python3", "writer.py", "-", "{seconds}", "{size}", "{every}",
                           "without.txt"], inputs=["writer.py"], outputs=["without.txt"], timeout=3600)
"""

# "STEP: ..." alone, "STEP    | ..." beside another step (console.py).
PULLED = re.compile(
    r"^(\S+?)(?::\s|\s+\|\s)checkpoints brought home \((\d+) file\(s\), ([\d.]+) MB copied in ([\d.]+) s\)"
)
# As bench_ssh.py: a login user of the bench's own, without root's shell
# start-up files (pyenv init on every ssh command), and the system Python.
LOGIN = "sxbench"
REMOTE_PYTHON = "/usr/bin/python3"


def ssh_project(base: Path, host: Any, every: float) -> Path:
    root = base / "proj"
    root.mkdir()
    settings = {
        "host": host.address, "port": host.port, "user": host.user, "identity_file": str(host.client_key),
        "known_hosts": str(host.known_hosts), "remote_root": f"{host.scratch}/remote", "sandbox": "auto",
        "lifetime_minutes": 60.0, "checkpoint_seconds": every, "python": REMOTE_PYTHON,
    }  # fmt: skip
    lines = ["[tool.substrax.compute]", 'default_backend = "ssh"', "",
             "[tool.substrax.compute.backends.ssh]"]  # fmt: skip
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    lines += ["", "[tool.substrax.compute.cache]", "enabled = false"]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return root


def write_steps(root: Path, *, seconds: float, size: int, every: float) -> None:
    (root / "dodo.py").write_text(textwrap.dedent(DODO.format(seconds=seconds, size=size, every=every)))
    (root / "writer.py").write_text(WRITER_PY)


def run_both(root: Path, env: dict[str, str], log: Path) -> list[str]:
    """`doit -n 2 -P thread`: both steps side by side; its output, each line timed, kept in `log`."""
    started = time.monotonic()
    said: list[str] = []
    argv = [*doit_argv(), "-n", "2", "-P", "thread"]
    with subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:  # fmt: skip
        for line in proc.stdout or ():
            said.append(line)
            print(f"{time.monotonic() - started:7.1f} {line}", end="", flush=True)
    with log.open("a") as f:
        f.write("".join(said))
    if proc.returncode != 0:
        raise SystemExit(f"doit exit {proc.returncode}")
    return said


def step_times(root: Path, step: str) -> tuple[float, float]:
    """(launch started -> promoted, the run phase) of the step's latest run, in seconds."""
    handles = [json.loads(p.read_text()) for p in (root / ".substrax" / "runs").glob("*/handle.json")]
    handle = max((h for h in handles if h["step"] == step), key=lambda h: str(h["created_at"]))
    times = handle["state"]["times"]
    wall = parse(times["promote"]["end"]) - parse(times["launch"]["start"])
    return wall, parse(times["run"]["end"]) - parse(times["run"]["start"])


def pulls(said: list[str], step: str) -> tuple[int, float, float]:
    """(snapshots pulled, MB copied, seconds) of the step, from its client's lines."""
    found = [m for m in map(PULLED.search, said) if m and m.group(1) == step]
    return len(found), sum(float(m.group(3)) for m in found), sum(float(m.group(4)) for m in found)


# One repeat: (with: wall, run phase; without: wall, run phase; the pulls of "with").
Row = tuple[float, float, float, float, tuple[int, float, float]]


def report(bed: str, args: argparse.Namespace, rows: list[Row]) -> None:
    with_wall, with_run = median([r[0] for r in rows]), median([r[1] for r in rows])
    without_wall, without_run = median([r[2] for r in rows]), median([r[3] for r in rows])
    ratio = median([r[0] / r[2] for r in rows])
    count, mb, secs = rows[-1][4]
    print(f"\n{REPO}: checkpoints overhead, {bed} bed, {args.size} MiB every {args.every:g} s for "
          f"{args.seconds:g} s, side by side, {len(rows)} repeat(s)")  # fmt: skip
    print("| figure | value |\n| --- | --- |")
    print(f"| with checkpoints=, launch -> promoted | {with_wall:.1f} s (run phase {with_run:.1f} s) |")
    print(f"| without, launch -> promoted | {without_wall:.1f} s (run phase {without_run:.1f} s) |")
    print(f"| ratio with / without | {ratio:.2f}x |")
    print(f"| snapshots pulled (last repeat) | {count}, {mb:.0f} MB copied, {secs:.1f} s pulling |")


def one_repeat(root: Path, env: dict[str, str], log: Path) -> Row:
    for out in ("with.txt", "without.txt"):
        (root / out).unlink(missing_ok=True)  # each repeat runs both again
    said = run_both(root, env, log)
    with_wall, with_run = step_times(root, "with")
    without_wall, without_run = step_times(root, "without")
    return with_wall, with_run, without_wall, without_run, pulls(said, "with")


def bench_ssh(args: argparse.Namespace) -> None:
    base = Path(tempfile.mkdtemp(prefix="substrax-bench-ckpt-", dir=scratch_parent()))
    host = None
    try:
        host = start_host(base / "host", user=LOGIN if os.geteuid() == 0 else None)
        root = ssh_project(base, host, args.every)
        write_steps(root, seconds=args.seconds, size=args.size, every=args.every)
        env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        rows = [one_repeat(root, env, base / "doit.log") for _ in range(args.repeats)]
        report("ssh (namespace sshd)", args, rows)
    finally:
        if host is not None:
            stop_host(host)
        shutil.rmtree(base, ignore_errors=True)


def bench_slurm(args: argparse.Namespace) -> None:
    from bench_warm import down_all
    from testbeds.slurm_cluster import DEFAULT_SKY_VENV, bed_down, bed_up

    if os.geteuid() != 0 or not (DEFAULT_SKY_VENV / "bin" / "sky").exists():
        print("bench_checkpoints.py: skipped: the Slurm test bed needs root, and SkyPilot in .sky-venv")
        return
    bed_folder_ready(args.bed_dir)
    bed = bed_up(args.bed_dir, sky_venv=DEFAULT_SKY_VENV, log=lambda line: print(f"[bed] {line}", flush=True))
    prefix = "sxckpt"
    try:
        with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
            root = sky_project(Path(tmp), bed, prefix, False, dodo="", idle_minutes=1)
            toml = root / "pyproject.toml"
            table = "[tool.substrax.compute.backends.skypilot]\n"
            text = toml.read_text().replace(table, f"{table}checkpoint_seconds = {args.every}\n")
            # The two steps side by side: a cluster each at once (the bed has the cores for two).
            toml.write_text(text.replace("max_parallel = 1\n", "max_parallel = 2\n"))
            write_steps(root, seconds=args.seconds, size=args.size, every=args.every)
            try:
                rows = [one_repeat(root, env_for(bed, None), args.bed_dir.parent / f"{prefix}.log")
                        for _ in range(args.repeats)]  # fmt: skip
            finally:
                down_all(bed, prefix)
            report("Slurm (SkyPilot)", args, rows)
    finally:
        if not args.keep_bed:
            bed_down(args.bed_dir)


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--bed", choices=["ssh", "slurm"], default="ssh")
    parser.add_argument("--size", type=int, default=1024, help="the checkpoint's size, MiB")
    parser.add_argument("--every", type=float, default=20.0,
                        help="checkpoint_seconds, and how often the step writes its checkpoint")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long the step writes checkpoints")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--bed-dir", type=Path, default=Path("/tmp/sxt-bench-ckpt/bed"),
                        help="the Slurm bed's folder")
    parser.add_argument("--keep-bed", action="store_true")
    args = parser.parse_args()
    (bench_ssh if args.bed == "ssh" else bench_slurm)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
