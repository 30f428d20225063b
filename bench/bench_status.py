#!/usr/bin/env python3
"""Figure of the CLI (issue 3): `substrax-compute status` with 1,000 runs.

    .venv/bin/python bench/bench_status.py [--runs 1000] [--repeats N]

It measures and prints; it asserts nothing. A project on tmpfs (/dev/shm
when present) gets `--runs` finished runs of the local backend, made with the
store's own API rather than by submitting (a submit starts a worker and
waits for it): `Project.new_run(spec)` writes each handle, the chain's
usual state is merged in (`update_state`: phase, key, key parts with input
hashes, manifest digest), and a status file shaped like the one
`remote/worker.py` writes is put where the local backend reads it. The runs
belong to 50 steps; their final states are mixed like a real store's: most
succeeded, some failed, cancelled or timed out, and a few "lost" (a
`running` record whose worker is gone: the backend then checks /proc).

Timed, as subprocesses, interleaved, `--repeats` times each (medians):

* `python -c pass` (the venv's interpreter): the floor of any Python CLI;
* `substrax-compute --version`: start-up plus the CLI's imports;
* `substrax-compute --project EMPTY status`: a project with no runs;
* the same with an ssh backend configured whose host never answers (a
  loopback socket that accepts and stays silent): status asks hosts for
  leaked machines only with `--machines`, so this costs what the line
  above costs, not ssh's connect_timeout (15 s; issue 20);
* `substrax-compute --project DIR status`: the latest run of each step;
* `substrax-compute --project DIR status --all` (every run; a table, stdout
  is a pipe, so no colours and rich's default width of 80 columns);
* `substrax-compute --project DIR status --all --json`.

Goal: status with 1,000 runs < 0.5 s. Each run's output is checked (exit 0,
every run listed, nothing unreadable). The project is removed at the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import cli_argv, scratch_parent

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends.job import STATUS_FILE
from substrax_tasks.step.spec import canonical_digest, make_spec
from substrax_tasks.store.phase import Phase
from substrax_tasks.store.project import Project

GOAL_SECONDS = 0.5
STEPS = 50
PYPROJECT = """\
[project]
name = "bench-status"
version = "0"

[tool.substrax.compute]
default_backend = "local"

[tool.substrax.compute.backends.local]
sandbox = "none"
"""
# (state, share of the runs); the rest succeeded
MIXED_STATES = (("failed", 0.05), ("cancelled", 0.03), ("timed_out", 0.02), ("lost", 0.01))


# ------------------------------------------------------------------ helpers




def iso(moment: float) -> str:
    return datetime.datetime.fromtimestamp(moment, datetime.timezone.utc).isoformat(timespec="milliseconds")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def state_for(index: int, runs: int) -> str:
    """Spread the mixed states evenly over the runs."""
    position = (index * 7919) % runs / runs  # a fixed shuffle
    low = 0.0
    for state, share in MIXED_STATES:
        if low <= position < low + share:
            return state
        low += share
    return "succeeded"


def worker_status(state: str, run_dir: Path, started: float, gone_pid: int) -> dict[str, Any]:
    """A status file as `remote/worker.py` leaves it for a finished run."""
    ended = started + 30.0 + (started % 600)
    exit_code: int | None = {"succeeded": 0, "failed": 1, "cancelled": -15, "timed_out": -15}.get(state)
    record: dict[str, Any] = {
        "state": state,
        "worker_pid": gone_pid,
        "worker_start_ticks": 123456,
        "pid": gone_pid + 1,
        "start_ticks": 123457,
        "exit_code": exit_code,
        "signal": "SIGTERM" if exit_code == -15 else None,
        "started_at": iso(started),
        "ended_at": iso(ended),
        "sandbox": "none",
        "outputs_root": str(run_dir.parent.parent.parent),
        "message": None,
    }
    if state == "lost":  # the worker was killed before it could write an end
        record.update(state="running", exit_code=None, signal=None, ended_at=None)
    return record


def make_store(root: Path, runs: int) -> None:
    """`runs` finished runs of the local backend, made with the store's API."""
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    project = Project.open(root)
    gone = dead_pid()
    base = time.time() - 30 * 24 * 3600
    for i in range(runs):
        step = f"train:seed={i % STEPS}"
        spec = make_spec(
            step,
            ["python3", "train.py", "--seed", i % STEPS, "--out", f"models/{i % STEPS}"],
            root,
            inputs=["data/train.csv", "train.py"],
            outputs=[f"models/{i % STEPS}/"],
            env={"OMP_NUM_THREADS": "1"},
            timeout=3600,
        )
        handle = project.new_run(spec)
        parts = {
            "command": spec.command,
            "inputs": {"data/train.csv": f"{i:064x}", "train.py": f"{i + 1:064x}"},
            "outputs": spec.outputs,
            "backend": "local",
        }
        state = state_for(i, runs)
        project.store.advance(  # the phase is recorded by advance alone
            handle,
            Phase.PROMOTED if state == "succeeded" else Phase.STARTED,
            key=canonical_digest(parts),
            key_parts=parts,
            **({"manifest_digest": canonical_digest([i])} if state == "succeeded" else {}),
        )
        run_dir = project.store.run_dir(handle.run_id)
        write_json_atomic(run_dir / STATUS_FILE, worker_status(state, run_dir, base + i * 60.0, gone))


# ------------------------------------------------------------------ timing


def silent_host() -> int:
    """A loopback port that accepts connections and never answers, as a
    host that hangs; served by a daemon thread until the bench exits."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)

    def serve() -> None:
        held = []  # open and unanswered: the client waits for a banner
        while True:
            held.append(listener.accept()[0])

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


@dataclass
class Case:
    name: str
    argv: list[str]
    expect_runs: int | None = None  # check the output lists this many runs
    json_output: bool = False
    times: list[float] = field(default_factory=list)
    last_stdout: str = ""
    last_stderr: str = ""

    def run(self) -> None:
        started = time.perf_counter()
        done = subprocess.run(self.argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
        self.times.append(time.perf_counter() - started)
        self.last_stdout = done.stdout.decode(errors="replace")
        self.last_stderr = done.stderr.decode(errors="replace")
        if done.returncode != 0:
            print(f"\n{self.name}: exit {done.returncode}\n{self.last_stderr[-3000:]}")
            raise SystemExit(1)
        self.check()

    def check(self) -> None:
        if self.expect_runs is None:
            return
        if self.json_output:
            data = json.loads(self.last_stdout)
            listed, unreadable = len(data["runs"]), len(data["unreadable"])
        else:
            listed = sum(1 for line in self.last_stdout.splitlines() if "train:seed=" in line)
            unreadable = self.last_stderr.count("unreadable")
        if listed != self.expect_runs or unreadable:
            print(f"\n{self.name}: listed {listed} runs, expected {self.expect_runs}")
            print(f"unreadable records reported: {unreadable}")
            raise SystemExit(1)


def states_seen(case: Case) -> dict[str, int]:
    counts: dict[str, int] = {}
    for run in json.loads(case.last_stdout)["runs"]:
        counts[run["state"]] = counts.get(run["state"], 0) + 1
    return dict(sorted(counts.items()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000, help="runs in the store (default 1000)")
    parser.add_argument("--repeats", type=int, default=11, help="timed runs of each command (default 11)")
    parser.add_argument("--keep", action="store_true", help="keep the generated project")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.repeats < 1:
        parser.error("--runs and --repeats must be at least 1")

    parent = scratch_parent()
    scratch = Path(tempfile.mkdtemp(prefix="bench-status-", dir=parent))
    print(f"bench_status: {platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, files in {scratch} ({'tmpfs' if parent else 'NOT tmpfs'})")
    try:
        full, empty = scratch / "project", scratch / "empty"
        started = time.perf_counter()
        make_store(full, args.runs)
        empty.mkdir()
        (empty / "pyproject.toml").write_text(PYPROJECT)
        hung = scratch / "hung"
        hung.mkdir()
        port = silent_host()
        (hung / "pyproject.toml").write_text(
            f'{PYPROJECT}\n[tool.substrax.compute.backends.ssh]\nhost = "127.0.0.1"\nport = {port}\n'
        )
        print(f"made {args.runs} runs with the store's API in {time.perf_counter() - started:.1f} s; "
              f"{args.repeats} timed runs of each command, interleaved")
        cli = cli_argv()
        status = [*cli, "--project", str(full)]
        cases = [
            Case("python -c pass", [sys.executable, "-c", "pass"]),
            Case("substrax-compute --version", [*cli, "--version"]),
            Case("status, 0 runs", [*cli, "--project", str(empty), "status"]),
            Case("status, 0 runs, an ssh host that hangs", [*cli, "--project", str(hung), "status"]),
            Case(f"status (latest of each), {args.runs} runs", [*status, "status"], min(STEPS, args.runs)),
            Case(f"status --all, {args.runs} runs", [*status, "status", "--all"], args.runs),
            Case(f"status --all --json, {args.runs} runs", [*status, "status", "--all", "--json"],
                 args.runs, json_output=True),
        ]
        for case in cases:  # warm the page cache and the .pyc files
            case.run()
        for rep in range(args.repeats):
            for case in cases if rep % 2 == 0 else cases[::-1]:
                case.run()
    finally:
        if args.keep:
            print(f"project kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    print(f"\nstates listed: {states_seen(cases[-1])}")
    print("\nwall time, seconds (median; min-max)")
    width = max(len(c.name) for c in cases)
    for case in cases:
        goal = ""
        if case.expect_runs is not None:
            met = statistics.median(case.times) < GOAL_SECONDS
            goal = f"goal < {GOAL_SECONDS} s: {'met' if met else 'MISSED'}"
        print(f"  {case.name:<{width}}  {statistics.median(case.times):6.3f}  "
              f"({min(case.times):.3f}-{max(case.times):.3f})  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
