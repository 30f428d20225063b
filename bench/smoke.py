#!/usr/bin/env python3
"""Every bench/bench_*.py run as shipped, at a size that takes seconds, and
its result checked (`make bench-smoke`, run by CI after `make test`).

    .venv/bin/python bench/smoke.py [SCRIPT ...]
    .venv/bin/python bench/smoke.py --e2e [SCRIPT ...]   # the Slurm bed's (root, ~15 min)

A bench that nobody runs rots: a helper moves, a rule changes, and the next
measurement finds a traceback instead of a figure. Each script here runs
with small size arguments (or its own `--smoke`/`--check`), and passes only
if it exits 0, prints no traceback and prints each of its figures named
below as a number above zero: a figure measured, not only a clean exit.
The sizes are far too small for the figures to mean anything; the goals are
not judged.

The scripts that need the Slurm test bed (bench_reuse.py, bench_warm.py,
bench_preemption.py) take minutes each even at their smallest (a cold
launch on the bed is 45-160 s): here only their imports and arguments are
checked (`--help`); `--e2e` (`make bench-smoke-e2e`, root) runs them at a
small size, each on a bed of its own. SCRIPT names a few scripts to run (bench_ssh.py ...); by default
all. A script new under bench/ with no line in SMOKES fails the run.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TIMEOUT_SECONDS = 600  # one script's, on a loaded machine; each takes seconds to a minute
STOP_GRACE_SECONDS = 60  # a stopped script's own clean-up (hosts, namespaces, users)
NUMBER = r"(\d[\d,]*(?:\.\d+)?)"


@dataclass(frozen=True)
class Smoke:
    script: str
    args: tuple[str, ...]
    # each must match a line of stdout; its group is a figure, which must be a number above zero
    figures: tuple[str, ...]


def _repo(rel: str) -> str:
    return str(REPO / rel)


SMOKES: tuple[Smoke, ...] = (
    Smoke("bench_lines.py", (), (rf"^total\s+\d+\s+{NUMBER}$",)),
    Smoke(
        "bench_manifest.py",
        ("--files", "300", "--big-mib", "4", "--repeats", "3", "--hash-repeats", "1"),
        (rf"^no-op outputs_match, .* {NUMBER}x", rf"^manifest sha256 of .* {NUMBER}x"),
    ),
    Smoke(
        "bench_chain.py",
        ("--steps", "3", "--repeats", "1", "--files", "3"),
        (rf"^\s+3\s+9\s+{NUMBER}\s", rf"^\s+3 steps: remote {NUMBER} "),
    ),
    Smoke(
        "bench_chain.py",
        ("--steps", "3", "--repeats", "1", "--files", "3", "--cache", "on"),
        (rf"^\s+3\s+9\s+{NUMBER}\s", rf"^\s+3 steps: remote {NUMBER} "),
    ),
    Smoke(
        "bench_steps.py",
        ("--steps", "3", "--repeats", "1", "--jobs", "1,2"),
        (rf"^\s+serial\s+remote\s+{NUMBER}", rf"^\s+-n 2 -P thread\s+remote\s+{NUMBER}"),
    ),
    Smoke(
        "bench_status.py",
        ("--runs", "30", "--repeats", "1"),
        (
            rf"^\s+status \(latest of each\), 30 runs\s+{NUMBER}",
            rf"^\s+status --all --json, 30 runs\s+{NUMBER}",
        ),
    ),
    Smoke(
        "bench_local.py",
        ("--trials", "1", "--repeats", "1"),
        (rf"^bwrap\s+true\s+10 ms\s+[\d.]+\s+{NUMBER}", rf"^none\s+sleep 1\s+10 ms\s+[\d.]+\s+{NUMBER}"),
    ),
    Smoke("bench_fetch_memory.py", ("--files", "200,400"), (rf"^\s+200\s+{NUMBER}", rf"^\s+400\s+{NUMBER}")),
    Smoke(
        "bench_fetch_once.py",
        ("--baseline", str(REPO), "--size-mib", "4", "--repeats", "1"),
        (rf"^before\s+{NUMBER}", rf"^after\s+{NUMBER}"),
    ),
    Smoke(
        "bench_cache.py",
        ("--size-mib", "4", "--files", "200", "--repeats", "1"),
        (
            rf"^\| 4 MiB from the local folder \| {NUMBER} s",
            rf"^\| 4 MiB from S3 \| {NUMBER} s",
            rf"^\| 200 small files from the local folder \| {NUMBER} s",
            rf"^\| no-op doit, 20 steps \| {NUMBER} s",
        ),
    ),
    Smoke(
        "bench_cache_disk.py",
        ("--files", "200", "--size-mib", "4", "--repeats", "1"),
        (rf"^\| this tree \| .* \| {NUMBER} s \|$",),
    ),
    Smoke("bench_ssh.py", ("--smoke",), (rf"^bench_ssh.py --smoke: ok, {NUMBER} figures measured",)),
    Smoke("bench_polling.py", ("--seconds", "3", "6"), (rf"^a 10-minute run: {NUMBER} ",)),
    Smoke(
        "bench_checkpoints.py",
        ("--bed", "ssh", "--size", "1", "--every", "1", "--seconds", "3"),
        (rf"^\| ratio with / without \| {NUMBER}x",),
    ),
    Smoke(
        "bench_tests.py",
        ("--repeats", "1", _repo("tests/unit/test_cli_views_unit.py")),
        (rf"^median: serial {NUMBER} s, xdist -n 2 {NUMBER} s",),
    ),
    Smoke("bench_layers.py", ("--check",), (rf"^bench_layers --check: {NUMBER} of \d+ layers removable",)),
    # the Slurm bed's: --e2e runs them (SMOKES_E2E); here, their imports and arguments
    Smoke("bench_reuse.py", ("--help",), (r"--steps STEPS",)),
    Smoke("bench_warm.py", ("--help",), (r"--cold-samples COLD_SAMPLES",)),
    Smoke("bench_preemption.py", ("--help",), (r"--count COUNT",)),
)

# `--e2e` (make bench-smoke-e2e, as root): the Slurm bed's benches at a small
# size, each bringing its bed up and down (minutes each: a cold launch on the
# bed takes 45-160 s), so not in CI's `make test`.
SMOKES_E2E: tuple[Smoke, ...] = (
    Smoke(
        "bench_reuse.py", ("--steps", "2", "--seconds", "2"), (rf"^\| ratio reuse / per-step \| {NUMBER}x",)
    ),
    Smoke(
        "bench_warm.py",
        ("--steps", "2", "--seconds", "2", "--warm-repeats", "1", "--cold-samples", "1"),
        (rf"^\| ratio \| {NUMBER}x",),
    ),
    Smoke(
        "bench_preemption.py",
        ("--count", "12", "--every", "2", "--after", "3"),
        (rf"^\| to running again \| {NUMBER} s", rf"^\| launch \| {NUMBER} s"),
    ),
)


def figure(value: str) -> float:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return math.nan


def problems(smoke: Smoke, code: int, out: str, err: str) -> list[str]:
    """What is wrong with one run (empty: sane)."""
    found = [f"exit status {code}"] if code != 0 else []
    if "Traceback (most recent call last)" in out + err:
        found.append("a traceback")
    for pattern in smoke.figures:
        match = re.search(pattern, out, re.MULTILINE)
        if match is None:
            found.append(f"no line matching {pattern!r}")
            continue
        values = [figure(v) for v in match.groups() if v is not None]
        if smoke.args != ("--help",) and not all(math.isfinite(v) and v > 0 for v in values):
            found.append(f"not a figure measured: {match.group(0).strip()!r}")
    return found


def run(smoke: Smoke) -> tuple[list[str], float, str]:
    """One script, in a session of its own. Stopped (a timeout, this runner
    interrupted or terminated), it is sent SIGINT first: the benches clean up
    on KeyboardInterrupt (their sshd hosts, namespaces and users), which a
    plain kill would leave behind; SIGKILL only after STOP_GRACE_SECONDS."""
    argv = [sys.executable, str(HERE / smoke.script), *smoke.args]
    print(f"==> {smoke.script} {' '.join(smoke.args)}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        out, err = stop(proc)
        return [f"no end after {TIMEOUT_SECONDS} s"], time.monotonic() - started, out + err
    except BaseException:
        stop(proc)
        raise
    return problems(smoke, proc.returncode, out, err), time.monotonic() - started, out + err


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGINT to the script's session, then SIGKILL if it does not end."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.communicate(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def terminated(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt("terminated")  # the running script is stopped as on Ctrl-C


def main(argv: Sequence[str] | None = None) -> int:
    wanted = list(sys.argv[1:] if argv is None else argv)
    smokes = SMOKES
    if "--e2e" in wanted:
        wanted.remove("--e2e")
        smokes = SMOKES_E2E
    unknown = [w for w in wanted if w not in {s.script for s in smokes}]
    if unknown:
        print(f"smoke: no smoke run for {', '.join(unknown)}; the scripts: "
              f"{', '.join(sorted({s.script for s in SMOKES}))}", file=sys.stderr)  # fmt: skip
        return 2
    unlisted = sorted({p.name for p in HERE.glob("bench_*.py")} - {s.script for s in SMOKES})
    failed: list[str] = []
    if unlisted and not wanted and smokes is SMOKES:
        failed.append(f"no smoke run for {', '.join(unlisted)}: give each a line in SMOKES (bench/smoke.py)")
    if os.geteuid() != 0:
        print("smoke: not root: the scripts that need the namespace sshd or other users say so and fail",
              file=sys.stderr)  # fmt: skip
    signal.signal(signal.SIGTERM, terminated)
    started = time.monotonic()
    for smoke in smokes:
        if wanted and smoke.script not in wanted:
            continue
        found, took, said = run(smoke)
        print(f"    {'ok' if not found else 'FAILED'} in {took:.1f} s", flush=True)
        if found:
            tail = "\n".join(said.strip().splitlines()[-30:])
            print(f"    {'; '.join(found)}\n--- its last lines\n{tail}\n---", flush=True)
            failed.append(f"{smoke.script} {' '.join(smoke.args)}: {'; '.join(found)}")
    print(f"bench smoke: {len(failed)} failed, in {time.monotonic() - started:.0f} s")
    for line in failed:
        print(f"  FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the running script was stopped and has cleaned up
        print("bench smoke: interrupted", file=sys.stderr)
        sys.exit(130)
