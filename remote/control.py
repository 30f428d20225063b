#!/usr/bin/env python3
"""Inspect, stop and time-limit runs on the machine that runs them.

Stdlib only, Python 3.8+: copied beside worker.py to remote machines and
called over SSH with one command per operation. Each prints one JSON line.

    python3 control.py status RUN_DIR
    python3 control.py cancel RUN_DIR [--wait SECONDS]
    python3 control.py watchdog RUN_DIR SECONDS [--detach] [--poweroff]
    python3 control.py remove RUN_DIR

fabric's lesson: closing an SSH channel kills nothing, so stopping a remote
tree takes an explicit command that signals the worker by pid (checked
against its start time, so a reused pid is never signalled).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

FINAL_STATES = ("succeeded", "failed", "timed_out", "cancelled")
WATCHDOG_POLL_SECONDS = 5.0

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# worker.py is shipped beside this file
from worker import START_LOCK, proc_start_ticks  # noqa: E402

start_ticks = proc_start_ticks


def alive(pid, ticks):
    # type: (object, object) -> bool
    return ticks is not None and start_ticks(pid) == ticks


def read_status(run_dir):
    # type: (str) -> dict | None
    try:
        with open(os.path.join(run_dir, "status.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def status(run_dir):
    # type: (str) -> dict
    """The worker's status, plus whether its worker is alive right now."""
    record = read_status(run_dir)
    if record is None:
        return {"state": None, "exists": os.path.isdir(run_dir)}
    worker_alive = alive(record.get("worker_pid"), record.get("worker_start_ticks"))
    if not worker_alive:
        record = read_status(run_dir) or record  # it may have just ended
    record["worker_alive"] = worker_alive
    record["exists"] = True
    return record


def cancel(run_dir, wait):
    # type: (str, float) -> dict
    """SIGTERM the worker (which stops the whole tree) and wait for its end.
    A worker that is gone already: kill what is left of the task's group."""
    record = read_status(run_dir)
    if record is None:
        if _end_before_start(run_dir):
            return {"cancelled": True, "state": "cancelled", "reason": "not started"}
        record = read_status(run_dir)  # the worker claimed the start meanwhile
        if record is None:
            return {"cancelled": False, "reason": "not started"}
    if record.get("state") in FINAL_STATES:
        return {"cancelled": False, "reason": "finished", "state": record.get("state")}
    if alive(record.get("worker_pid"), record.get("worker_start_ticks")):
        os.kill(record["worker_pid"], signal.SIGTERM)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            now = read_status(run_dir) or {}
            if now.get("state") in FINAL_STATES:
                return {"cancelled": True, "state": now.get("state")}
            time.sleep(0.02)
        return {"cancelled": False, "reason": "worker did not stop within %ss" % wait}
    record = read_status(run_dir) or record  # the worker may have just written its end
    if record.get("state") in FINAL_STATES:
        return {"cancelled": False, "reason": "finished", "state": record.get("state")}
    if alive(record.get("pid"), record.get("start_ticks")):
        try:
            os.killpg(record["pid"], signal.SIGKILL)
        except OSError:
            pass
    # No worker is left to record the end: record it here, so the run
    # reads as cancelled rather than lost.
    _write_status(run_dir, dict(record, state="cancelled", ended_at=_now(),
                                message="cancelled after its worker was lost"))
    return {"cancelled": True, "state": "cancelled", "reason": "worker was gone"}


def _now():
    # type: () -> str
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


def _write_status(run_dir, record):
    # type: (str, dict) -> None
    tmp = os.path.join(run_dir, "status.json.control.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(run_dir, "status.json"))


def _end_before_start(run_dir):
    # type: (str) -> bool
    """Under the worker's start lock: if no worker has claimed the run yet,
    write its end (`cancelled`), which a worker started later respects.
    False when the run folder is gone or a worker got there first."""
    import fcntl

    if not os.path.isdir(run_dir):
        return False
    fd = os.open(os.path.join(run_dir, START_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if read_status(run_dir) is not None:
            return False
        _write_status(run_dir, {"state": "cancelled", "message": "cancelled before the command started",
                                "exit_code": None, "started_at": None, "ended_at": _now()})
        return True
    finally:
        os.close(fd)  # closing releases the lock


def remove(run_dir):
    # type: (str) -> dict
    cancel(run_dir, 30.0)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"removed": not os.path.exists(run_dir)}


def watchdog(run_dir, seconds, poweroff=False):
    # type: (str, float, bool) -> dict
    """After `seconds`, stop the run's tree and remove its folder, so nothing
    outlives the run's lifetime even if no client ever comes back. Exits
    early once the folder is gone (the run was torn down). With `poweroff`
    (a cloud machine whose provider has no autodown) it then shuts the
    machine down."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not os.path.isdir(run_dir):
            return {"fired": False}
        time.sleep(min(WATCHDOG_POLL_SECONDS, max(0.0, deadline - time.monotonic())))
    if not os.path.isdir(run_dir):
        return {"fired": False}
    with open(os.path.join(run_dir, "watchdog-fired"), "w") as f:
        f.write(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    remove(run_dir)
    if poweroff:
        power_off()
    return {"fired": True}


def power_off():
    # type: () -> None
    import subprocess

    argv = ["shutdown", "-h", "now"] if os.geteuid() == 0 else ["sudo", "-n", "shutdown", "-h", "now"]
    try:
        subprocess.call(argv)
    except OSError:
        pass


def watchdog_child(run_dir, seconds, poweroff=False):
    # type: (str, float, bool) -> None
    """Body of the forked child: a new session, then a grandchild that is
    immune to the SSH session's end runs the watchdog."""
    os.setsid()
    if os.fork():
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    info = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "seconds": seconds,
            "armed_at": time.time()}
    tmp = os.path.join(run_dir, "watchdog.json.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, os.path.join(run_dir, "watchdog.json"))
    watchdog(run_dir, seconds, poweroff)


def main(argv=None):
    # type: (list | None) -> int
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        sys.stderr.write(__doc__ or "")
        return 2
    command, run_dir = args[0], args[1]
    if command == "status":
        result = status(run_dir)
    elif command == "cancel":
        wait = float(args[args.index("--wait") + 1]) if "--wait" in args else 30.0
        result = cancel(run_dir, wait)
    elif command == "remove":
        result = remove(run_dir)
    elif command == "watchdog" and len(args) >= 3:
        seconds = float(args[2])
        poweroff = "--poweroff" in args
        if "--detach" in args:
            os.makedirs(run_dir, exist_ok=True)
            result = _detach_and_wait(run_dir, seconds, poweroff)
        else:
            result = watchdog(run_dir, seconds, poweroff)
    else:
        sys.stderr.write("unknown command: %s\n" % " ".join(args))
        return 2
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


def _detach_and_wait(run_dir, seconds, poweroff=False):
    # type: (str, float, bool) -> dict
    path = os.path.join(run_dir, "watchdog.json")
    if os.path.exists(path):
        os.unlink(path)
    pid = os.fork()
    if pid == 0:
        try:
            watchdog_child(run_dir, seconds, poweroff)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            time.sleep(0.01)
    return {"pid": None, "error": "watchdog did not start"}


if __name__ == "__main__":
    sys.exit(main())
