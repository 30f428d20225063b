#!/usr/bin/env python3
"""Figures of the doit chain (issue 3): the no-op `doit` with remote steps.

    .venv/bin/python bench/bench_chain.py [--steps 10,100,1000] [--repeats N]
        [--files 100] [--outputs folder|files] [--sandbox none|bwrap|auto]
        [--build-jobs N] [--keep] [--src DIR]

It measures and prints; it asserts nothing. For each step count N it makes
two projects on tmpfs (/dev/shm when present) and builds each once with
`doit`:

* remote: N steps declared with `remote_step()` (local backend), each with
  two inputs (a shared script `gen.py` and an input file of its own) and
  `--files` (default 100) output files, written by `python3 gen.py IN OUTDIR
  FILES` (stdlib). With `--outputs folder` (the default) they are declared
  as one folder output `out/sNNNN/` (one doit target); with `--outputs
  files` each file `out/sNNNN/fNNN.txt` is declared (100 targets).
* baseline: N plain doit tasks with the same `file_dep` and `targets`, and a
  Python action writing the same files. Both projects hold the same
  pyproject.toml (doit reads its `[tool.doit]` table in either). With folder outputs its target is
  the folder (doit checks that it exists), while the remote step's check
  stats every file in it: that is part of what is measured.

`--outputs files` declares each file (100 targets a step): loading the dodo
file then checks 100 x N outputs for overlaps, through an index of declared
paths (`spec.PathIndex`), in time proportional to their count.

Both dodo files use doit's `sqlite3` dep file (`substrax_tasks.doit_config`
for the remote one, which also sets the project's summary reporter; the
same backend and file for the baseline) and set `default_tasks` to the N
public tasks, so plain `doit` asks exactly the N tasks whether they are up
to date (the remote steps' internal phase tasks are loaded, not asked).

After the build it waits until the newest output is older than the racy
window (`RACY_SECONDS`: the outputs' tree stamp and a step's proof are kept
only for what is older), runs one untimed no-op `doit` in each project
(shown as "1st no-op": the remote one records its outputs' stamps and the
steps' proofs then), and then times
the no-op `doit` (a subprocess, wall time, output through pipes) in both
projects, interleaved and alternating which goes first, `--repeats` times;
medians are shown with their ratio (goal: <= 1.5x at 100 steps). What `doit`
printed on the last timed no-op is summarised: `-- NAME` lines are tasks
found up to date, `. NAME` lines are tasks that ran.

`--src DIR` times a third project alongside: a copy of the built remote
project whose `doit` runs another version's package (`PYTHONPATH=DIR`, DIR
holding its `substrax_tasks/` and `remote/`, e.g. `git archive main
substrax_tasks remote | tar -x -C DIR`), interleaved with the other two: an
A/B of two versions under the same load. Besides wall times, the CPU time
of each `doit` (user + system, its children included) is shown: on a
shared machine it moves less with the load than the wall time does.

The build of the remote project runs `doit -n BUILD_JOBS -P thread` (the
steps mostly wait on their workers), with its output going to a file: with
its stdout on a pipe, a threaded doit died of SIGSEGV in 5 of 5 tries at 100
steps (CPython 3.11's TextIOWrapper is not safe for writes from several
threads, gh-119506 / gh-118138). A build that dies of a signal anyway is
rerun, and after BUILD_ATTEMPTS deaths finished serially. `--build-jobs 1`
builds serially. The local backend's sandbox is "none" by default (setup
speed; the sandbox takes no part in a no-op run). The projects are removed
at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _common import doit_argv, load_average, median, scratch_parent

import substrax_tasks
from substrax_tasks.backends.scripts import remote_script

GOAL_RATIO = 1.5
GOAL_STEPS = 100
BUILD_TIMEOUT_SECONDS = 3 * 3600.0
NOOP_TIMEOUT_SECONDS = 600.0
BUILD_ATTEMPTS = 4

GEN_PY = '''\
"""Write COUNT small files into OUTDIR, derived from INPUT."""
import os
import sys

src, outdir, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(src) as f:
    seed = f.read()
os.makedirs(outdir, exist_ok=True)
for j in range(count):
    with open(os.path.join(outdir, "f%03d.txt" % j), "w") as f:
        f.write("%s file %d\\n" % (seed.strip(), j))
'''

COMMON_DODO = '''\
N = {steps}
FILES = {files}
MODE = {mode!r}
NAMES = ["s%04d" % i for i in range(N)]


def outputs(name):
    if MODE == "folder":
        return ["out/%s/" % name]
    return ["out/%s/f%03d.txt" % (name, j) for j in range(FILES)]


def inputs(name):
    return ["gen.py", "in/%s.txt" % name]
'''

REMOTE_DODO = '''\
"""{steps} remote steps (generated by bench/bench_chain.py)."""
from substrax_tasks import doit_config, remote_step

{common}
DOIT_CONFIG = doit_config(default_tasks=NAMES)


def task_steps():
    for name in NAMES:
        yield from remote_step(
            name,
            command=["python3", "gen.py", "in/%s.txt" % name, "out/%s" % name, str(FILES)],
            inputs=inputs(name),
            outputs=outputs(name),
        )
'''

BASELINE_DODO = '''\
"""{steps} plain doit tasks with the same file_dep and targets (generated by
bench/bench_chain.py)."""
import os

{common}
DOIT_CONFIG = {{"dep_file": ".doit.db", "backend": "sqlite3", "default_tasks": NAMES}}


def write_files(src, outdir, count):
    with open(src) as f:
        seed = f.read()
    os.makedirs(outdir, exist_ok=True)
    for j in range(count):
        with open(os.path.join(outdir, "f%03d.txt" % j), "w") as f:
            f.write("%s file %d\\n" % (seed.strip(), j))


def task_steps():
    for name in NAMES:
        yield {{
            "basename": name,
            "actions": [(write_files, ["in/%s.txt" % name, "out/%s" % name, FILES])],
            "file_dep": inputs(name),
            "targets": [o.rstrip("/") for o in outputs(name)],
        }}
'''

PYPROJECT = """\
[project]
name = "bench-chain"
version = "0"

[tool.substrax.compute]
default_backend = "local"

[tool.substrax.compute.backends.local]
sandbox = "{sandbox}"

[tool.substrax.compute.cache]
enabled = {cache}
"""


# ------------------------------------------------------------------ helpers



PYCACHE = Path(tempfile.gettempdir()) / f"substrax-bench-pycache-{os.getuid()}"


def parse_steps(text: str) -> list[int]:
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps wants numbers separated by commas, got {text!r}") from None
    if not steps or any(n <= 0 for n in steps):
        raise argparse.ArgumentTypeError(f"--steps wants positive numbers, got {text!r}")
    return steps


@dataclass
class Project:
    kind: str  # "remote" or "baseline"
    root: Path
    build_seconds: float = float("nan")
    first_noop: float = float("nan")
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # user + system seconds of each timed doit
    pythonpath: str | None = None  # another version's package (--src)
    last_cpu: float = float("nan")
    last_maxrss_kib: int = 0
    maxrss_kib: list[int] = field(default_factory=list)  # peak memory of each timed doit
    last_output: str = ""
    last_code: int = 0
    build_crashes: int = 0


@dataclass(frozen=True)
class Options:
    files: int
    mode: str  # "folder" or "files"
    sandbox: str
    repeats: int
    build_jobs: int
    src: str | None
    cache: bool
    build_chunk: int


def write_project(root: Path, kind: str, steps: int, opts: Options) -> Project:
    root.mkdir(parents=True)
    (root / "in").mkdir()
    (root / "gen.py").write_text(GEN_PY)
    for i in range(steps):
        (root / "in" / f"s{i:04d}.txt").write_text(f"input of s{i:04d}\n")
    common = COMMON_DODO.format(steps=steps, files=opts.files, mode=opts.mode)
    template = REMOTE_DODO if kind == "remote" else BASELINE_DODO
    (root / "dodo.py").write_text(template.format(steps=steps, common=common))
    # The same pyproject.toml in both: doit reads its [tool.doit] table (and
    # imports tomllib for that) whichever tasks the dodo file declares.
    pyproject = PYPROJECT.format(sandbox=opts.sandbox, cache=str(opts.cache).lower())
    (root / "pyproject.toml").write_text(pyproject)
    return Project(kind, root)


def run_doit(
    project: Project,
    extra: Sequence[str] = (),
    timeout: float = NOOP_TIMEOUT_SECONDS,
    log: Path | None = None,
) -> float:
    """Run `doit` in the project; returns its wall time. Keeps its output,
    read through pipes, or through the file `log` (used for the threaded
    build: see the module doc)."""
    # Bytecode cached as in any installed package (both sides alike), but in
    # a folder of the bench's own, so that nothing is written into the repo.
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(PYCACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("SUBSTRAX_BACKEND", None)
    if project.pythonpath:
        env["PYTHONPATH"] = project.pythonpath
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(log.open("wb")) if log is not None else subprocess.PIPE
        started = time.perf_counter()
        proc = subprocess.Popen(
            [*doit_argv(), *extra], cwd=project.root, env=env, stdin=subprocess.DEVNULL,
            stdout=sink, stderr=subprocess.STDOUT,
        )
        timer = threading.Timer(timeout, proc.kill)  # a safety net: a hung doit is killed
        timer.start()
        try:
            output = proc.stdout.read() if proc.stdout is not None else b""
            # wait4: this doit's own CPU time and peak memory (ru_maxrss)
            _pid, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        elapsed = time.perf_counter() - started
        if proc.stdout is not None:
            proc.stdout.close()
    project.last_cpu = usage.ru_utime + usage.ru_stime
    project.last_maxrss_kib = usage.ru_maxrss
    text = log.read_text(errors="replace") if log is not None else output.decode(errors="replace")
    project.last_output = text
    project.last_code = proc.returncode
    return elapsed


def newest_mtime_ns(root: Path) -> int:
    newest = 0
    for folder, _dirs, names in os.walk(root / "out"):
        for name in names:
            newest = max(newest, os.stat(os.path.join(folder, name)).st_mtime_ns)
    return newest


def disk_used(root: Path) -> int:
    """Bytes the tree takes on its file system (allocated blocks, as du)."""
    used = 0
    for folder, _dirs, names in os.walk(root):
        for name in [".", *names]:
            used += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return used


def count_files(root: Path) -> int:
    return sum(len(names) for _folder, _dirs, names in os.walk(root / "out"))


def summarise(output: str) -> tuple[int, int, list[str]]:
    """(tasks up to date, tasks that ran, other lines) in doit's output."""
    lines = output.splitlines()
    skipped = sum(1 for line in lines if line.startswith("-- "))
    ran = sum(1 for line in lines if line.startswith(". "))
    other = [line for line in lines if not line.startswith(("-- ", ". "))]
    return skipped, ran, other


def fail(project: Project, what: str) -> None:
    tail = "\n".join(project.last_output.splitlines()[-30:])
    print(f"\n{project.kind} project ({project.root}): {what} (exit {project.last_code}); last lines:")
    print(tail)
    raise SystemExit(1)


# ------------------------------------------------------------------ one size


@dataclass
class Row:
    steps: int
    remote: Project
    baseline: Project
    files_per_step: int
    src: Project | None = None


def build(project: Project, steps: int, files: int, jobs: int, chunk: int) -> None:
    """A `doit` that makes everything, or one per `chunk` steps (`--build-chunk`:
    a doit that ran more than ~1,000 local steps died of `select()` on a
    descriptor past 1,024, issue 29 item 1). The remote project is built with
    threads; a threaded doit that dies of a signal (seen: SIGSEGV, see the
    module doc) is rerun (it reattaches to the runs it started), and after
    BUILD_ATTEMPTS such deaths the rest is built serially."""
    started = time.perf_counter()
    threaded = project.kind == "remote" and jobs > 1
    log = project.root.parent / f"{project.root.name}.build.log"
    names = [f"s{i:04d}" for i in range(steps)]
    for first in range(0, steps, chunk):
        part = names[first:first + chunk] if steps > chunk else []
        for _attempt in range(BUILD_ATTEMPTS):
            extra = ["-n", str(jobs), "-P", "thread"] if threaded else []
            run_doit(project, [*extra, *part], timeout=BUILD_TIMEOUT_SECONDS, log=log)
            if project.last_code >= 0 or not threaded:
                break
            project.build_crashes += 1
            died = f"died of signal {-project.last_code}"
            print(f" [{project.kind} build {died}, rerunning]", end="", flush=True)
        else:
            run_doit(project, part, timeout=BUILD_TIMEOUT_SECONDS, log=log)
        if project.last_code != 0:
            break
    project.build_seconds = time.perf_counter() - started
    if project.last_code != 0:
        fail(project, "the build failed")
    expected = steps * files
    found = count_files(project.root)
    if found != expected:
        fail(project, f"the build made {found} output files, expected {expected}")


def compile_bytecode() -> str:
    """Compile the package (and remote/, loaded from its file) to bytecode,
    as a pip install leaves an installed package. An editable install in a
    shell with PYTHONDONTWRITEBYTECODE=1 (this bench's machine) never writes
    it, and every `doit` would then compile ~10,000 lines from source
    (~50-90 ms), while doit itself, in site-packages, has its bytecode."""
    folders = [Path(substrax_tasks.__file__).parent, remote_script("manifest.py").parent]
    for folder in folders:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(folder)], check=True)
    return ", ".join(str(f) for f in folders)


def racy_seconds() -> float:
    """The hash cache's racy window, read from remote/manifest.py itself (the
    package loads it from that file too): a tree younger than this is
    verified every time, so the no-op would measure hashing."""
    spec = importlib.util.spec_from_file_location("bench_remote_manifest", remote_script("manifest.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return float(getattr(module, "RACY_SECONDS", 2.0))


def wait_out_racy_window(projects: Sequence[Project]) -> None:
    racy_ns = racy_seconds() * 1_000_000_000
    newest = max(newest_mtime_ns(p.root) for p in projects)
    wait = (newest + racy_ns - time.time_ns()) / 1e9 + 0.5
    if wait > 0:
        time.sleep(wait)


def measure_size(scratch: Path, steps: int, opts: Options) -> Row:
    remote = write_project(scratch / f"remote-{steps}", "remote", steps, opts)
    baseline = write_project(scratch / f"baseline-{steps}", "baseline", steps, opts)
    print(f"\n{steps} steps x {opts.files} files: building ...", end="", flush=True)
    for project in (baseline, remote):
        build(project, steps, opts.files, opts.build_jobs, opts.build_chunk)
        print(f" {project.kind} {project.build_seconds:.1f} s", end="", flush=True)
    used = disk_used(remote.root) + disk_used(baseline.root)
    print(f"; disk used by the two projects {used / 2**20:,.0f} MiB", flush=True)
    projects = [remote, baseline]
    src = None
    if opts.src:
        # a copy: the two versions' proofs and caches stay apart (its files
        # are new to the file system, so the racy window is waited out again)
        src = Project("src", scratch / f"remote-{steps}-src", pythonpath=opts.src)
        shutil.copytree(remote.root, src.root, symlinks=True)
        projects.append(src)
        time.sleep(racy_seconds() + 0.5)
    wait_out_racy_window(projects)
    for project in projects:
        project.first_noop = run_doit(project)
        if project.last_code != 0:
            fail(project, "the first no-op run failed")
    print(f"timing the no-op runs ({load_average()})", flush=True)
    for rep in range(opts.repeats):
        for project in projects if rep % 2 == 0 else projects[::-1]:
            project.times.append(run_doit(project))
            project.cpu.append(project.last_cpu)
            project.maxrss_kib.append(project.last_maxrss_kib)
            if project.last_code != 0:
                fail(project, "a no-op run failed")
    return Row(steps, remote, baseline, opts.files, src)


def report_output(row: Row) -> None:
    for project in (row.remote, row.baseline, *([row.src] if row.src else [])):
        skipped, ran, other = summarise(project.last_output)
        verdict = "no task ran" if ran == 0 else f"{ran} TASK(S) RAN"
        print(
            f"  {project.kind:8} doit exit {project.last_code}: {skipped} task(s) up to date (`-- NAME`), "
            f"{ran} ran (`. NAME`): {verdict}"
        )
        lines = project.last_output.splitlines()
        shown = lines[:2] + (["..."] if len(lines) > 3 else []) + lines[-1:] if len(lines) > 2 else lines
        for line in shown:
            print(f"      | {line}")
        for line in other[:5]:
            print(f"      other output: {line}")


# ------------------------------------------------------------------ main


def print_report(rows: Sequence[Row]) -> None:
    print("\nno-op `doit` wall time, seconds (median of runs; min-max)")
    header = (
        f"{'steps':>6} {'files':>7} {'remote':>8} {'(min-max)':>13} {'baseline':>9} {'(min-max)':>13} "
        f"{'ratio':>6} {'per step +':>11} {'1st no-op r/b':>14} {'build r/b':>13}  goal"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        r, b = median(row.remote.times), median(row.baseline.times)
        ratio = r / b
        extra_ms = (r - b) / row.steps * 1000
        goal = ""
        if row.steps == GOAL_STEPS:
            goal = f"<= {GOAL_RATIO}x: {'met' if ratio <= GOAL_RATIO else 'MISSED'}"
        print(
            f"{row.steps:>6} {row.steps * row.files_per_step:>7} {r:>8.3f} "
            f"{min(row.remote.times):>6.3f}-{max(row.remote.times):<6.3f} {b:>9.3f} "
            f"{min(row.baseline.times):>6.3f}-{max(row.baseline.times):<6.3f} {ratio:>5.2f}x "
            f"{extra_ms:>8.2f} ms {row.remote.first_noop:>6.2f}/{row.baseline.first_noop:<6.2f} "
            f"{row.remote.build_seconds:>6.0f}/{row.baseline.build_seconds:<5.0f}  {goal}"
        )
    print("\nCPU time of each no-op `doit` (user + system), seconds, medians; ratios to the baseline's")
    for row in rows:
        r, b = median(row.remote.cpu), median(row.baseline.cpu)
        line = f"{row.steps:>6} steps: remote {r:.3f} ({r / b:.2f}x), baseline {b:.3f}"
        if row.src is not None:
            s = median(row.src.cpu)
            line += f", --src {s:.3f} ({s / b:.2f}x; remote/--src {r / s:.3f})"
        print(line)
    print("\nThe remote project's extra CPU time over the baseline's (medians), per step and per output file")
    for row in rows:
        extra = median(row.remote.cpu) - median(row.baseline.cpu)
        print(f"{row.steps:>6} steps: {extra / row.steps * 1000:.3f} ms a step, "
              f"{extra / (row.steps * row.files_per_step) * 1e6:.2f} us an output file")
    print("\nPeak memory (ru_maxrss) of each no-op `doit`, MiB, medians")
    for row in rows:
        r, b = median(row.remote.maxrss_kib) / 1024, median(row.baseline.maxrss_kib) / 1024
        per_step = (r - b) * 1024 / row.steps
        line = f"{row.steps:>6} steps: remote {r:.1f}, baseline {b:.1f} (+{per_step:.1f} KiB a step)"
        if row.src is not None:
            line += f", --src {median(row.src.maxrss_kib) / 1024:.1f}"
        print(line)
    for row in rows:
        if row.src is not None:
            s = median(row.src.times)
            print(f"{row.steps:>6} steps, wall: --src {s:.3f} s ({s / median(row.baseline.times):.2f}x the "
                  f"baseline; remote/--src {median(row.remote.times) / s:.3f})")
            # each repeat ran both one after the other: the ratio within a
            # repeat moves less with the machine's load than either time
            for what, mine, theirs in (("wall", row.remote.times, row.src.times),
                                       ("CPU", row.remote.cpu, row.src.cpu)):
                pairs = sorted(m / o for m, o in zip(mine, theirs, strict=True))
                print(f"{row.steps:>6} steps, remote/--src {what} per repeat: median {median(pairs):.3f} "
                      f"({pairs[0]:.3f}-{pairs[-1]:.3f}, {len(pairs)} repeats)")
    print(f"({load_average()} at the end)")
    print(
        "\nper step +: the remote project's extra no-op time per step; 1st no-op: the first run after the "
        "build (the remote one makes each step's full check once: its key, the manifest of its outputs "
        "from the hashes cached when they were verified, and keeps the proofs later no-ops use)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=parse_steps, default=[10, 100, 1000], help="step counts (default 10,100,1000)"
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed no-op runs per project (default 7)")
    parser.add_argument("--files", type=int, default=100, help="output files per step (default 100)")
    parser.add_argument(
        "--outputs", choices=("folder", "files"), default="folder",
        help="one folder output per step (default) or each file declared",
    )
    parser.add_argument("--sandbox", choices=("none", "bwrap", "auto"), default=None,
                        help='default "none"; "bwrap" with --cache on (runs without it are never kept)')
    parser.add_argument(
        "--build-jobs", type=int, default=8, help="doit -n N -P thread for the remote build (default 8)"
    )
    parser.add_argument(
        "--cache", choices=("on", "off"), default="off",
        help="the cache of runs in the remote project (default off: a no-op never reads it, and keeping "
        "100 files a step in the user's cache made a build of 1,000 steps quadratic, issue 29)",
    )
    parser.add_argument(
        "--build-chunk", type=int, default=1000, metavar="N",
        help="build with one doit per N steps (default 1,000: see build())",
    )
    parser.add_argument(
        "--dir", metavar="DIR", help="make the projects in a new folder under DIR (default: tmpfs); "
        "10,000 steps x 100 files is a million files: a disk, not memory",
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated projects")
    parser.add_argument(
        "--src", metavar="DIR", help="also time a copy of the remote project run with another version's "
        "package (PYTHONPATH=DIR: its substrax_tasks/ and remote/), interleaved",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.files < 1 or args.build_chunk < 1:
        parser.error("--repeats, --files and --build-chunk must be at least 1")
    if args.cache == "on" and args.sandbox == "none":
        parser.error("--cache on with --sandbox none keeps nothing: a run without the sandbox is never kept "
                     "in the run cache (docs/cache.md); leave --sandbox out or give bwrap")
    args.sandbox = args.sandbox or ("bwrap" if args.cache == "on" else "none")

    parent = args.dir or scratch_parent()
    scratch = Path(tempfile.mkdtemp(prefix="bench-chain-", dir=parent))
    print(f"bench_chain: {platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, files in {scratch} "
          f"({'tmpfs' if parent == scratch_parent() else 'NOT tmpfs'})")
    declared = "one folder output per step" if args.outputs == "folder" else "each file declared as an output"
    print(f"outputs: {args.files} files per step, {declared}; sandbox {args.sandbox!r}; "
          f"{args.repeats} timed no-op runs per project, interleaved")
    print(f"bytecode compiled for {compile_bytecode()} (as a pip install leaves it)")
    if args.src and not (Path(args.src) / "substrax_tasks" / "__init__.py").is_file():
        parser.error(f"--src {args.src}: no substrax_tasks/ package in it; extract one with "
                     "`git archive REV substrax_tasks remote | tar -x -C DIR`")
    opts = Options(args.files, args.outputs, args.sandbox, args.repeats, args.build_jobs,
                   str(Path(args.src).resolve()) if args.src else None, args.cache == "on",
                   args.build_chunk)
    rows: list[Row] = []
    try:
        for steps in args.steps:
            row = measure_size(scratch, steps, opts)
            rows.append(row)
            report_output(row)
    finally:
        if args.keep:
            print(f"\nprojects kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    print_report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
