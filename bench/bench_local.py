#!/usr/bin/env python3
"""Figures of the local backend (issue 2): cancel latency and run overhead.

    .venv/bin/python bench/bench_local.py [--trials N] [--repeats N] [--sandbox bwrap|none]

It measures and prints; it asserts nothing. Two figures, each with the
sandbox (bubblewrap) and without it (sandbox = "none"):

1. Cancel: time from `substrax-compute --project DIR cancel RUN` (the real
   CLI, as a subprocess) to the whole task tree gone, and the same through
   `backend.cancel(handle)` in this process, so the CLI's start-up cost shows
   separately. The task is `sh -c SCRIPT MARKER`: it starts a descendant that
   double-forks and calls `setsid` (so it leaves the task's session and
   process group), then sleeps. Every process of the tree carries the run's
   unique marker in its argv (the sleeps take it as an extra, tiny
   duration: GNU sleep adds its arguments up). "Gone" means no process whose
   /proc/PID/cmdline contains the marker is left; this script scans /proc
   itself. The task dies on SIGTERM (default handlers), so the grace period
   (5 s) is not what is measured. Goal: < 0.5 s.

2. Overhead: wall time of `project.submit(spec)` + waiting until the run is
   final, against the same command run bare with `subprocess.run`, in the
   same loop (interleaved, alternating which goes first). Waiting is shown
   twice: polling every 10 ms (close to the backend's own cost) and with
   `Backend.wait()`'s default poll interval (what `wait()` and
   `substrax-compute logs --follow` give a user). Goal: overhead < 0.5 s.

Projects live in temporary folders (under /dev/shm when present) that are
removed at the end; every process the benchmark leaves behind is stopped by
pid.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _common import cli_argv, fmt_s, load_average, marker_processes, median, read_cmdline, scratch_parent

from substrax_tasks.backends.base import LOG_POLL_SECONDS, RunStatus
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project

GRACE_SECONDS = 5.0
TIGHT_POLL_SECONDS = 0.01
SCAN_PAUSE_SECONDS = 0.001  # between two /proc scans while waiting for "gone"
TREE_UP_TIMEOUT = 15.0  # the task tree must be up within this after submit
GONE_TIMEOUT = GRACE_SECONDS + 15.0  # give up watching a cancel after this
GOAL_SECONDS = 0.5
SANDBOXES = ("bwrap", "none")


# ------------------------------------------------------------------ /proc




def session_and_group(pid: int) -> tuple[int, int] | None:
    """(session id, process group id) of `pid`, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return int(fields[3]), int(fields[2])  # session, pgrp


def kill_marked(marker: bytes) -> int:
    """SIGKILL, by pid, every process still carrying `marker` (each one
    re-checked just before the signal, against pid reuse). Returns how many."""
    killed = 0
    for _round in range(50):
        pids = marker_processes(marker)
        if not pids:
            break
        for pid in pids:
            argv = read_cmdline(pid)
            if argv is not None and any(marker in arg for arg in argv):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
        time.sleep(0.02)
    return killed


# ------------------------------------------------------------------ helpers




def settings(sandbox: str) -> dict[str, object]:
    return {"sandbox": sandbox, "grace_seconds": GRACE_SECONDS}




def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@dataclass
class Bench:
    """One temporary project and everything to clean up behind it."""

    project: Project
    cli: list[str]
    markers: list[bytes] = field(default_factory=list)
    handles: list[RunHandle] = field(default_factory=list)

    def submit(self, name: str, command: list[str], sandbox: str) -> RunHandle:
        spec = make_spec(name, command, self.project.root)
        handle = self.project.submit(spec, backend="local", settings=settings(sandbox))
        self.handles.append(handle)
        return handle

    def cleanup(self) -> list[str]:
        """Stop whatever is still going; returns notes on what had to be done."""
        notes: list[str] = []
        for handle in self.handles:
            backend = self.project.backend_for(handle)
            try:
                if not backend.poll(handle).final:
                    backend.cancel(handle)
                    notes.append(f"run {handle.run_id} was still going: cancelled")
            except Exception as exc:  # noqa: BLE001 - cleanup goes on whatever one run does
                notes.append(f"run {handle.run_id}: cancel failed: {exc}")
        for marker in self.markers:
            killed = kill_marked(marker)
            if killed:
                notes.append(f"{killed} process(es) with marker {marker.decode()} killed by pid")
        return notes


# ------------------------------------------------------------------ 1. cancel


@dataclass
class CancelSample:
    gone: float  # seconds from the cancel call to no marked process left (nan: never)
    returned: float  # seconds from the cancel call to the CLI exit / cancel() return
    escaped: bool  # the setsid grandchild had left the task's session and group
    state: str  # the run's state afterwards
    ok: bool  # the CLI exited 0 / cancel() returned True without raising
    error: str = ""


def task_command(marker: str) -> list[str]:
    """sh -c SCRIPT MARKER: a double-forked, setsid descendant, then a sleep.
    The sleeps read MARKER+"1" / MARKER+"2" as extra (tiny) durations."""
    escapee = f"{marker}1"
    sleeper = f"{marker}2"
    script = f'(setsid sh -c "sleep 300 {escapee}; :" {marker} &); sleep 300 {sleeper}; :'
    return ["sh", "-c", script, marker]


def wait_tree_up(marker: str) -> tuple[int, int] | None:
    """Wait until both sleeps run; returns (escaped sleep pid, task sleep pid)."""
    escapee, sleeper = f"{marker}1".encode(), f"{marker}2".encode()
    deadline = time.monotonic() + TREE_UP_TIMEOUT
    while time.monotonic() < deadline:
        pids: dict[bytes, int] = {}
        for pid, argv in marker_processes(marker.encode()).items():
            if argv[0].rsplit(b"/", 1)[-1] == b"sleep":
                for wanted in (escapee, sleeper):
                    if wanted in argv[1:]:
                        pids[wanted] = pid
        if len(pids) == 2:
            return pids[escapee], pids[sleeper]
        time.sleep(0.005)
    return None


def cancel_trial(bench: Bench, sandbox: str, via: str, scan_times: list[float]) -> CancelSample:
    marker = f"0.000{secrets.randbelow(10**12):012d}"
    bench.markers.append(marker.encode())
    handle = bench.submit("bench-cancel", task_command(marker), sandbox)
    tree = wait_tree_up(marker)
    if tree is None:
        state = bench.project.backend_for(handle).poll(handle).state
        kill_marked(marker.encode())  # whatever did start; the run itself is cancelled at cleanup
        return CancelSample(
            float("nan"), float("nan"), False, state, False, f"the task tree never came up (run {state})"
        )
    escapee_ids, sleeper_ids = session_and_group(tree[0]), session_and_group(tree[1])
    escaped = (
        escapee_ids is not None
        and sleeper_ids is not None
        and escapee_ids[0] != sleeper_ids[0]  # another session
        and escapee_ids[1] != sleeper_ids[1]  # another process group
    )

    backend = bench.project.backend_for(handle)
    outcome: dict[str, object] = {}
    done: Callable[[], bool]
    proc: subprocess.Popen[bytes] | None = None
    t0 = time.perf_counter()
    if via == "cli":
        cli = subprocess.Popen(
            [*bench.cli, "--project", str(bench.project.root), "cancel", handle.run_id],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        proc = cli
        done = lambda: cli.poll() is not None  # noqa: E731
    else:

        def call() -> None:
            try:
                outcome["result"] = backend.cancel(handle)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                outcome["error"] = str(exc)

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        done = lambda: not thread.is_alive()  # noqa: E731

    gone: float | None = None
    returned: float | None = None
    needle = marker.encode()
    while True:
        now = time.perf_counter()
        if gone is None:
            left = marker_processes(needle)
            scan_end = time.perf_counter()
            scan_times.append(scan_end - now)
            if not left:
                gone = scan_end - t0  # all gone by the end of this scan at the latest
        if returned is None and done():
            returned = time.perf_counter() - t0
        if (gone is not None and returned is not None) or now - t0 > GONE_TIMEOUT:
            break
        time.sleep(SCAN_PAUSE_SECONDS)

    error = ""
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            _out, err = proc.communicate(timeout=GONE_TIMEOUT)
            ok = proc.returncode == 0
            error = err.decode(errors="replace").strip()
        if proc.returncode is None:
            proc.kill()
            proc.wait()
            ok, error = False, "the CLI did not exit"
    else:
        ok = outcome.get("result") is True
        error = str(outcome.get("error", ""))
    state = backend.poll(handle).state
    nan = float("nan")
    return CancelSample(
        nan if gone is None else gone, nan if returned is None else returned, escaped, state, ok, error
    )


def bench_cancel(bench: Bench, sandboxes: Sequence[str], trials: int) -> None:
    samples: dict[tuple[str, str], list[CancelSample]] = {}
    scan_times: list[float] = []
    for i in range(trials):
        for sandbox in sandboxes:
            # alternate which path goes first, so drift hits both alike
            for via in ("cli", "in-process") if i % 2 == 0 else ("in-process", "cli"):
                sample = cancel_trial(bench, sandbox, via, scan_times)
                samples.setdefault((sandbox, via), []).append(sample)
                if sample.error:
                    print(f"  [{sandbox} {via} trial {i + 1}] {sample.error}", file=sys.stderr)
        print(f"  cancel: trial {i + 1}/{trials} done", file=sys.stderr, end="\r")
    print(file=sys.stderr)

    rows = []
    for (sandbox, via), got in samples.items():
        gone = [s.gone for s in got if not math.isnan(s.gone)]
        back = [s.returned for s in got if not math.isnan(s.returned)]
        label = "substrax-compute cancel (CLI)" if via == "cli" else "backend.cancel() in-process"
        rows.append(
            [
                sandbox,
                label,
                fmt_s(median(gone)),
                fmt_s(max(gone) if gone else float("nan")),
                fmt_s(median(back)),
                fmt_s(max(back) if back else float("nan")),
                f"{len(gone)}/{len(got)}",
                f"{sum(s.escaped for s in got)}/{len(got)}",
                ",".join(sorted({s.state for s in got})),
                f"{sum(s.ok for s in got)}/{len(got)}",
            ]
        )
    print_table(
        f"1. cancel -> whole task tree gone (seconds; {trials} trials each; goal < {GOAL_SECONDS} s)",
        [
            "sandbox", "via", "gone med", "gone max", "returned med", "returned max",
            "gone", "setsid escaped", "state after", "exit ok",
        ],
        rows,
    )
    print(
        "  gone: no /proc/*/cmdline holds the run's marker (bwrap, sh, the setsid'd sh, the sleeps);"
        "\n  returned: the CLI process exited / backend.cancel() returned."
        f"\n  /proc scan: median {median(scan_times) * 1000:.1f} ms per scan, plus a"
        f" {SCAN_PAUSE_SECONDS * 1000:.0f} ms pause: the resolution of 'gone'."
    )


def bench_cli_startup(bench: Bench, trials: int) -> None:
    """What the CLI costs before it does any work."""
    finished = bench.submit("bench-finished", ["true"], "none")
    bench.project.backend_for(finished).wait(finished, poll_seconds=TIGHT_POLL_SECONDS)
    commands = {
        "substrax-compute --version": [*bench.cli, "--version"],
        "substrax-compute cancel <finished run>": [
            *bench.cli, "--project", str(bench.project.root), "cancel", finished.run_id,
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(trials):
        for name, argv in commands.items():
            t0 = time.perf_counter()
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, check=False)
            times[name].append(time.perf_counter() - t0)
    print_table(
        f"   CLI start-up alone (seconds; {trials} runs each)",
        ["command", "median", "max"],
        [[name, fmt_s(median(t)), fmt_s(max(t))] for name, t in times.items()],
    )


# ------------------------------------------------------------------ 2. overhead


def run_and_wait(
    bench: Bench, command: list[str], sandbox: str, poll: float | None
) -> tuple[float, float, str]:
    """(seconds to submit, seconds to final, final state) of one local run."""
    t0 = time.perf_counter()
    handle = bench.submit("bench-overhead", command, sandbox)
    submitted = time.perf_counter() - t0
    backend = bench.project.backend_for(handle)
    status: RunStatus = backend.wait(handle) if poll is None else backend.wait(handle, poll_seconds=poll)
    return submitted, time.perf_counter() - t0, status.state


def bare(command: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(command, cwd=cwd, stdin=subprocess.DEVNULL, check=False)
    return time.perf_counter() - t0


def bench_overhead(bench: Bench, sandboxes: Sequence[str], repeats: int) -> None:
    commands = {"true": ["true"], "sleep 1": ["sleep", "1"]}
    rows = []
    for sandbox in sandboxes:
        for label, command in commands.items():
            bare_t: list[float] = []
            submit_t: list[float] = []
            tight_t: list[float] = []
            default_t: list[float] = []
            states: set[str] = set()
            variants: list[tuple[float | None, list[float]]] = [
                (0.0, bare_t), (TIGHT_POLL_SECONDS, tight_t), (None, default_t),
            ]
            for i in range(repeats):
                # rotate the order each repeat: each variant goes first as often
                for poll, into in variants[i % 3 :] + variants[: i % 3]:
                    if into is bare_t:
                        bare_t.append(bare(command, bench.project.root))
                        continue
                    submitted, total, state = run_and_wait(bench, command, sandbox, poll)
                    submit_t.append(submitted)
                    into.append(total)
                    states.add(state)
            base = median(bare_t)
            for wait_label, runs in (
                (f"{TIGHT_POLL_SECONDS * 1000:.0f} ms", tight_t),
                (f"{LOG_POLL_SECONDS * 1000:.0f} ms (wait() default)", default_t),
            ):
                run = median(runs)
                rows.append(
                    [
                        sandbox, label, wait_label, fmt_s(base), fmt_s(run), fmt_s(run - base),
                        f"{run / base:.1f}x" if base > 0 else "-", fmt_s(median(submit_t)),
                        ",".join(sorted(states)),
                    ]
                )
            print(f"  overhead: {sandbox} / {label} done", file=sys.stderr)
    print_table(
        f"2. local run vs the bare command (seconds, medians of {repeats};"
        f" goal: overhead < {GOAL_SECONDS} s)",
        ["sandbox", "command", "wait poll", "bare", "run", "overhead", "ratio", "submit", "states"],
        rows,
    )
    print(
        "  run: Project.submit() + Backend.wait() until final; bare: subprocess.run(); interleaved."
        "\n  submit: median time for submit() to return (handle written, worker started, command started),"
        "\n  over both wait variants."
    )


# ------------------------------------------------------------------ main


@contextlib.contextmanager
def temporary_bench() -> Iterator[Bench]:
    root = Path(tempfile.mkdtemp(prefix="substrax-bench-", dir=scratch_parent()))
    bench = Bench(Project.open(root), cli_argv())
    try:
        yield bench
    finally:
        for note in bench.cleanup():
            print(f"cleanup: {note}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)


def describe_machine() -> None:
    bwrap = shutil.which("bwrap")
    version = "not installed"
    if bwrap:
        got = subprocess.run([bwrap, "--version"], capture_output=True, text=True, check=False)
        version = got.stdout.strip() or "unknown version"
    print(
        f"substrax-tasks local backend bench  |  {platform.node()}  {os.cpu_count()} CPUs  "
        f"Linux {platform.release()}  Python {platform.python_version()}  {version}"
        f"\nprojects under {scratch_parent() or tempfile.gettempdir()}; "
        f"settings {{sandbox: bwrap|none, grace_seconds: {GRACE_SECONDS:g}}}; {load_average()}"
    )



def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=20, help="cancel trials per case (default 20)")
    parser.add_argument("--repeats", type=int, default=10, help="overhead repeats per case (default 10)")
    parser.add_argument(
        "--sandbox", action="append", choices=SANDBOXES, help="only this sandbox (repeatable; default both)"
    )
    parser.add_argument("--skip", action="append", choices=("cancel", "overhead"), default=[])
    args = parser.parse_args(argv)
    if args.trials < 1 or args.repeats < 1:
        parser.error("--trials and --repeats must be at least 1")
    sandboxes = list(dict.fromkeys(args.sandbox or SANDBOXES))
    if "bwrap" in sandboxes and shutil.which("bwrap") is None:
        print("bubblewrap is not installed: the sandboxed cases are skipped", file=sys.stderr)
        sandboxes.remove("bwrap")
    describe_machine()
    with temporary_bench() as bench:
        if "cancel" not in args.skip and sandboxes:
            bench_cancel(bench, sandboxes, args.trials)
            bench_cli_startup(bench, args.trials)
        if "overhead" not in args.skip and sandboxes:
            bench_overhead(bench, sandboxes, args.repeats)
    print(f"\nat the end: {load_average()}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # cleanup already ran in temporary_bench()
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
