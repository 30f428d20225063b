#!/usr/bin/env python3
"""What following an SSH run costs the host (issue 18, item 5): processes
started on the host while `doit` waits for a run.

    .venv/bin/python bench/bench_polling.py [--seconds SHORT LONG] [--doit PATH]

As root: the test bed's throwaway sshd (tests/support/testbeds/sshd_host.py) in a
network namespace of its own, a user made for the bench. One step whose
command sleeps `--seconds` runs through the real `doit` (`--doit` picks the
installation, e.g. /work/main/.venv/bin/doit for the release before). Once
its handle says the sync ended, `strace -f -e trace=execve` is attached to
the host's sshd processes: every program started under them from then on
(the worker and the command, each ssh command's shell, python3, tail, ...)
is one line, until the handle says the run phase is over; the processes
started are the pids among them (a shell that execs its command is one). Two runs of
different lengths (20 s and 60 s by default) give what each minute of
following a run costs; the figure is a 10-minute run from those (goal:
fewer than 30), or measured, with `--seconds 20 600`. The window includes
starting the worker and the fetch after the run, which every run pays. It measures and prints; it
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_ssh import testbed

REPO = Path(__file__).resolve().parent.parent
GOAL_PER_10_MINUTES = 30

def phase(root: Path) -> str | None:
    for handle in (root / ".substrax" / "runs").glob("*/handle.json"):
        try:
            return str(json.loads(handle.read_text())["state"].get("phase"))
        except (OSError, ValueError, KeyError):
            return None
    return None


def measure(doit: str, seconds: int, base: Path) -> tuple[int, float]:
    """(processes started on the host while the run was followed, seconds followed)."""
    host = testbed.start_host(base / "host", user=f"sxpoll{os.getpid() % 100000}")
    strace = None
    proc = None
    try:
        root = base / "proj"
        root.mkdir()
        settings = {
            "host": host.address, "port": host.port, "user": host.user,
            "identity_file": str(host.client_key), "known_hosts": str(host.known_hosts),
            "python": host.python, "sandbox": "none", "remote_root": str(host.scratch / "remote"),
        }  # fmt: skip
        lines = ["[tool.substrax.compute]", 'default_backend = "ssh"', "",
                 "[tool.substrax.compute.backends.ssh]"]  # fmt: skip
        lines += [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
        # Each doit runs its step: the run cache (the user's, by default)
        # would restore a step it ran before, and there would be nothing to follow.
        lines += ["", "[tool.substrax.compute.cache]", "enabled = false"]
        (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
        (root / "dodo.py").write_text(
            "from substrax_tasks import doit_config, remote_step\n\n"
            'DOIT_CONFIG = doit_config(default_tasks=["wait"])\n\n\n'
            "def task_wait():\n"
            f'    yield from remote_step("wait", shell="sleep {seconds} && echo done > out.txt", '
            'outputs=["out.txt"])\n'
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SUBSTRAX_", "DOIT_"))}
        quiet = subprocess.DEVNULL
        proc = subprocess.Popen([doit], cwd=root, env=env, stdout=quiet, stderr=quiet)
        while phase(root) not in ("synced", "started"):  # a poll may miss the short "synced"
            if proc.poll() is not None:
                raise SystemExit(f"doit ended before its run phase (exit {proc.returncode})")
            time.sleep(0.01)
        trace = base / "strace.out"
        # The listener and each connection's sshd (paramiko's connection was
        # made at launch): every session from now on is a child of one.
        sshds = [host.pid, *testbed.descendants(host.pid)]
        strace = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=execve", "-o", str(trace),
                                   *(arg for pid in sshds for arg in ("-p", str(pid)))])  # fmt: skip
        started = time.monotonic()
        while phase(root) in ("synced", "started") and proc.poll() is None:
            time.sleep(0.05)
        followed = time.monotonic() - started
        strace.send_signal(signal.SIGINT)  # detaches; its file is whole once it exits
        try:
            strace.wait(timeout=30)
        except subprocess.TimeoutExpired:
            strace.kill()  # the kernel detaches the tracees; at most its last lines are lost
            strace.wait()
        proc.wait(timeout=120)
        if proc.returncode != 0 or not (root / "out.txt").is_file():
            raise SystemExit(f"the run failed (doit exit {proc.returncode})")
        execs = [line for line in trace.read_text().splitlines() if "execve(" in line and "= 0" in line]
        programs = Counter(line.split('"')[1].rsplit("/", 1)[-1] for line in execs)
        named = ", ".join(f"{n} {name}" for name, n in programs.most_common())
        # A shell that execs its command is one process running two programs.
        processes = len({line.split()[0] for line in execs})
        print(f"  {processes} processes ran {len(execs)} programs in {followed:.1f} s: {named}")
        return processes, followed
    finally:
        for child in (strace, proc):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
        testbed.stop_host(host)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, nargs=2, default=[20, 60], metavar=("SHORT", "LONG"),
                        help="how long the step runs, in the two runs measured")  # fmt: skip
    parser.add_argument("--doit", default=str(REPO / ".venv" / "bin" / "doit"), help="the doit to drive")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("strace") is None:
        print("needs root and strace (apt-get install strace)", file=sys.stderr)
        return 2
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    points = []
    for seconds in args.seconds:
        with tempfile.TemporaryDirectory(prefix="bench-polling-", dir=shm) as tmp:
            count, followed = measure(args.doit, seconds, Path(tmp))
        points.append((followed, count))
        print(f"a {seconds} s run, followed for {followed:.1f} s: {count} processes started on the host")
    # What each second of following costs, from the two; a run's own count
    # varies by a few (a log read more or less), so a slope at or below
    # zero reads as none, and the longer run's count is the base.
    (t1, c1), (t2, c2) = points
    per_second = max(0.0, (c2 - c1) / (t2 - t1))
    print(f"doit: {args.doit}")
    print(f"per minute followed: {per_second * 60:.1f}")
    print(f"a 10-minute run: {c2 + per_second * max(0.0, 600 - t2):.0f} (goal < {GOAL_PER_10_MINUTES})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
