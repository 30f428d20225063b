#!/usr/bin/env python3
"""A run's status file, and the one way to read, stop and time-limit a run.

Stdlib only, Python 3.8+. The local backend loads this file into its own
process; over SSH it runs beside worker.py, one command per operation, each
printing one JSON line:

    python3 control.py status RUN_DIR
    python3 control.py follow RUN_DIR OFFSET LIMIT
    python3 control.py cancel RUN_DIR [--wait SECONDS]
    python3 control.py watchdog RUN_DIR SECONDS [--poweroff]
    python3 control.py remove RUN_DIR

It imports one sibling, runfiles.py (the status file's definition), which
imports none.
`follow` streams the run's log instead (raw bytes from OFFSET, at most
LIMIT) until the run has ended or its stdin closes (the client went): one
follower per wait, not a status command every fraction of a second.

Closing an SSH channel kills nothing (fabric's lesson): a remote tree is
stopped by signalling its worker by pid, checked against its start time.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Iterator, Mapping, cast

# Imported by the client as substrax_tasks._remote.control; run as a script
# (or imported by worker.py) on a host, beside its siblings.
PACKAGED = bool(__package__)
if PACKAGED:
    from . import runfiles
else:
    # Run isolated (python3 -I: no script folder on sys.path), as every
    # script is on a host: its siblings are found beside it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import runfiles

FINAL_STATES = ("succeeded", "failed", "timed_out", "cancelled")
STATUS_FILE = "status.json"
START_LOCK = "start.lock"  # the worker takes it to start, a cancel of a run not started to end it
WATCHDOG_POLL_SECONDS = 5.0
FOLLOW_POLL_SECONDS = 0.2  # how soon a follower sends new log lines and sees the end
FOLLOW_CHUNK = 1 << 16
CANCEL_WAIT_SECONDS = 30.0
# In the command's environment, a value of the run's own (its status file's
# `mark`): every process of its tree inherits it, even one that called
# setsid or double-forked, so a tree whose worker is gone is still found.
RUN_MARK = "SUBSTRAX_RUN_MARK"
LEFTOVER_SECONDS = 5.0  # how long a lost run's tree may take to stop


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def write_json_atomic(path: str, data: Mapping[str, Any]) -> None:
    """temp file + fsync + rename: a reader sees the old or the new file, whole."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(data, indent=1, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def start_ticks(pid: object) -> int | None:
    """Start time of a live process in clock ticks since boot (the guard
    against pid reuse); None for no such process, or a zombie."""
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # it has finished; only its parent's wait is left
    return int(fields[19])


def alive(pid: object, ticks: object) -> bool:
    """True while `pid` is still the process that started at `ticks`."""
    return ticks is not None and start_ticks(pid) == ticks


def run_cgroup(record: dict[str, Any]) -> str | None:
    """The cgroup v2 the worker made for the command, if it is still there."""
    path = record.get("cgroup")
    if isinstance(path, str) and os.path.basename(path).startswith("substrax-") and os.path.isdir(path):
        return path
    return None


def _cgroup_pids(path: str | None) -> set[int]:
    if path is None:
        return set()
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return {int(line) for line in f if line.strip()}
    except OSError:  # gone
        return set()


def _carries(pid: int, mark: bytes) -> bool:
    """Whether process `pid` has the run's mark in its environment (only
    readable for our own processes: another user's is never ours)."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return mark in b"\0" + f.read()
    except OSError:
        return False


def leftovers(record: dict[str, Any]) -> list[int]:
    """The live processes of a run's command tree, found from its status
    record alone (its worker may be gone): those in the command's cgroup;
    those carrying its mark (RUN_MARK) and started no earlier than its
    worker (the environment of an older process cannot be the run's); and
    those in the command's session or process group (its pid: it started
    one of its own), which a process that scrubbed its environment cannot
    leave without setsid. A session or group id is the run's only while its
    leader is the command or no process at all: the kernel reuses no pid
    still in use as a group or session id, so while any of them lives
    that id cannot name another's."""
    found = _cgroup_pids(run_cgroup(record))
    mark = record.get("mark")
    marked = ("\0%s=%s\0" % (RUN_MARK, mark)).encode() if isinstance(mark, str) and mark else None
    since = record.get("worker_start_ticks")
    leader, leader_ticks = record.get("pid"), record.get("start_ticks")
    by_session = isinstance(leader, int) and isinstance(leader_ticks, int) and (
        alive(leader, leader_ticks) or start_ticks(leader) is None)
    for pid in [int(name) for name in os.listdir("/proc") if name.isdigit()]:
        if pid == os.getpid() or pid in found:
            continue
        try:
            with open("/proc/%d/stat" % pid, "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        fields = raw[raw.rfind(")") + 2 :].split()
        state, group, session, ticks = fields[0], int(fields[2]), int(fields[3]), int(fields[19])
        if state == "Z" or (isinstance(since, int) and ticks < since):
            continue
        if (marked is not None and _carries(pid, marked)) or (
                by_session and leader in (group, session) and ticks >= int(leader_ticks or 0)):
            found.add(pid)
    return sorted(pid for pid in found if start_ticks(pid) is not None)  # zombies are done


def stop_leftovers(record: dict[str, Any], seconds: float = LEFTOVER_SECONDS) -> list[int]:
    """Stop what is left of a run whose worker is gone (leftovers()), then
    remove the command's cgroup; the pids still alive after `seconds`.
    The cgroup is killed whole; the rest are stopped (SIGSTOP: a stopped
    process cannot fork) until a look finds none not stopped already, then
    killed, as the worker itself does (proctree.kill_all)."""
    deadline = time.monotonic() + seconds
    cgroup = run_cgroup(record)
    if cgroup is not None:
        with contextlib.suppress(OSError), open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
            f.write("1")
    stopped: set[int] = set()
    while True:
        left = leftovers(record)
        new = [pid for pid in left if pid not in stopped]
        if new and time.monotonic() < deadline:
            _signal(new, signal.SIGSTOP)
            stopped.update(new)
            continue
        _signal(left, signal.SIGKILL)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    while cgroup is not None and os.path.isdir(cgroup):
        try:
            os.rmdir(cgroup)  # refused (EBUSY) until its last process is gone
        except OSError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
    return leftovers(record)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            os.kill(pid, sig)


def tree_alive(run_dir: str) -> bool:
    """Whether any process of the run in `run_dir` is alive: its worker, or
    what its command left when its worker died without ending it."""
    record = read_status(run_dir)
    if record is None or damage_of(record) is not None:
        return False
    if alive(record.get("worker_pid"), record.get("worker_start_ticks")):
        return True
    return record.get("state") not in FINAL_STATES and bool(leftovers(record))


@contextlib.contextmanager
def start_lock(run_dir: str) -> Iterator[None]:
    """Held by the worker while it claims the start and by a cancel while it
    ends a run not started, so that exactly one of them wins."""
    fd = os.open(os.path.join(run_dir, START_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def read_status(run_dir: str) -> dict[str, Any] | None:
    return read_json(os.path.join(run_dir, STATUS_FILE))


def status(run_dir: str) -> runfiles.StatusAnswer:
    """The worker's status, plus whether its worker is alive right now. A
    status file that is there but damaged is said so (`damaged`), with the
    workers of the run still going (`worker_pids`)."""
    path = os.path.join(run_dir, STATUS_FILE)
    record = read_status(run_dir)
    if record is None and not os.path.lexists(path):
        return {"state": None, "exists": os.path.isdir(run_dir)}
    damage = damage_of(record)
    if damage is not None:
        return {"state": None, "exists": True, "damaged": "%s %s" % (path, damage),
                "worker_pids": workers_of(run_dir)}
    assert record is not None
    worker_alive = alive(record.get("worker_pid"), record.get("worker_start_ticks"))
    if not worker_alive:
        record = read_status(run_dir) or record  # it may have just ended
    record["worker_alive"] = worker_alive
    record["exists"] = True
    return cast(runfiles.StatusAnswer, record)


# What the worker writes in each field (remote/worker.py); the times and
# the message are str or None, these are int or None.
STATES = ("starting", "running") + FINAL_STATES
INT_FIELDS = ("worker_pid", "worker_start_ticks", "pid", "start_ticks", "exit_code")
TEXT_FIELDS = ("started_at", "ended_at", "message")


def damage_of(record: dict[str, Any] | None) -> str | None:
    """What is wrong with a status record the worker cannot have written,
    or None. The file is written whole (by rename): damage is from outside."""
    if record is None:
        return "is not a JSON object"
    # None: written before the status file had a version, in the same shape
    if record.get("version", runfiles.STATUS_VERSION) != runfiles.STATUS_VERSION:
        return "is of version %r, and this reads version %d (written by another release)" % (
            record.get("version"), runfiles.STATUS_VERSION)
    if record.get("state") not in STATES:
        return "names no state the worker writes (state %r)" % (record.get("state"),)
    for key in INT_FIELDS:
        value = record.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return "has %s = %r, not a whole number" % (key, value)
    for key in TEXT_FIELDS:
        if not isinstance(record.get(key), (str, type(None))):
            return "has %s = %r, not a string" % (key, record.get(key))
    if record["state"] in ("starting", "running") and record.get("worker_pid") is None:
        return "names no worker for a run that is %s" % record["state"]
    return None


# A worker runs as `python3 -ISB worker.py JOB` (on a host: CHECKED_RUN's
# flags, in the client's backends/remote_run.py; `python3 worker.py JOB`
# by an older client), or forked by the local backend's spawner (then its
# command line is the spawner's).
WORKER_SCRIPTS = ("worker.py", "spawner.py")


def workers_of(run_dir: str) -> list[int]:
    """The live workers of the run in `run_dir` (a damaged status file names
    none): the worker processes holding its log, which each opens before it
    writes any status (the command holds it too, but runs no worker script)."""
    log = os.path.realpath(os.path.join(run_dir, "run.log"))
    found = []
    for pid in [int(name) for name in os.listdir("/proc") if name.isdigit()]:
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                argv = f.read().split(b"\0")[:3]
            if not any(os.path.basename(a.decode(errors="replace")) in WORKER_SCRIPTS for a in argv):
                continue
            fds = "/proc/%d/fd" % pid
            if any(os.readlink(os.path.join(fds, fd)) == log for fd in os.listdir(fds)) \
                    and start_ticks(pid) is not None:  # not a zombie
                found.append(pid)
        except OSError:
            continue  # gone meanwhile, or another user's
    return found


def ended(record: runfiles.StatusAnswer) -> bool:
    """Whether a status() says the run is over: finished, its worker gone
    without an end (lost), or its folder gone."""
    state = record.get("state")
    if record.get("damaged"):  # the client says so; over once no worker of it goes
        return not record.get("worker_pids")
    if state is None:
        return not record.get("exists")
    return state in FINAL_STATES or not record.get("worker_alive")


class LogRefused(Exception):
    """The log is not a regular file: a link or a device put in its place."""


def send_log(run_dir: str, offset: int, limit: int) -> int:
    """Write the log from `offset` (up to `limit` bytes in all) to stdout;
    the new offset. Only a regular file is read: a log replaced by a link or
    a device (/dev/zero) would be read without end."""
    path = os.path.join(run_dir, "run.log")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return offset
    except OSError:  # ELOOP: a symlink
        raise LogRefused(path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LogRefused(path)
        while offset < limit:
            chunk = os.pread(fd, min(FOLLOW_CHUNK, limit - offset), offset)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(1, view):]
            offset += len(chunk)
    finally:
        os.close(fd)
    return offset


def follow(run_dir: str, offset: int, limit: int) -> int:
    """Stream the log until the run has ended (then the log is whole: it is
    read after the status that says so) or stdin closes, so it never
    outlives the client by more than a poll. Exit 3: the log is not a
    regular file."""
    poller = select.poll()
    poller.register(0, select.POLLIN)
    try:
        while True:
            over = ended(status(run_dir))
            offset = send_log(run_dir, offset, limit)
            if over:
                return 0
            if poller.poll(FOLLOW_POLL_SECONDS * 1000) and not os.read(0, 4096):
                return 0  # the client went
    except LogRefused as exc:
        sys.stderr.write("the run's log %s is not a regular file\n" % exc)
        return 3
    except BrokenPipeError:
        return 0  # the client went while we wrote


def cancel(run_dir: str, wait: float) -> dict[str, Any]:
    """SIGTERM the worker (which stops the whole tree) and wait for its end.
    A worker that is gone already: stop what is left of the task's tree
    (stop_leftovers), and only then record the run's end."""
    record = read_status(run_dir)
    if record is None:
        if end_before_start(run_dir):
            return {"cancelled": True, "state": "cancelled", "reason": "not started"}
        record = read_status(run_dir)  # the worker claimed the start meanwhile
        if record is None:
            return {"cancelled": False, "reason": "not started"}
    running = record.get("state") not in FINAL_STATES
    if running and alive(record.get("worker_pid"), record.get("worker_start_ticks")):
        os.kill(record["worker_pid"], signal.SIGTERM)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            now = read_status(run_dir) or {}
            if now.get("state") in FINAL_STATES:
                return {"cancelled": True, "state": now.get("state")}
            time.sleep(0.02)
        return {"cancelled": False, "reason": "worker (pid %s) did not stop within %ss of SIGTERM"
                % (record["worker_pid"], wait)}
    record = read_status(run_dir) or record  # the worker may have just written its end
    if record.get("state") in FINAL_STATES:
        return {"cancelled": False, "reason": "finished", "state": record.get("state")}
    left = stop_leftovers(record)
    if left:  # said, and the run not recorded ended: a rerun must not start beside them
        return {"cancelled": False, "left": left, "reason": "its worker is gone and %d process(es) of its "
                "command (pid %s) did not stop" % (len(left), ", ".join(map(str, left)))}
    # No worker is left to record the end: record it here, so the run
    # reads as cancelled rather than lost. Under the start lock, as the
    # run's guard (worker.py) records an end: one end, never one written
    # over the other.
    with start_lock(run_dir):
        record = read_status(run_dir) or record
        if record.get("state") in FINAL_STATES:
            return {"cancelled": False, "reason": "finished", "state": record.get("state")}
        write_json_atomic(os.path.join(run_dir, STATUS_FILE), dict(
            record, state="cancelled", ended_at=now_iso(), message="cancelled after its worker was lost"))
    return {"cancelled": True, "state": "cancelled", "reason": "worker was gone"}


def end_before_start(run_dir: str) -> bool:
    """Under the start lock: if no worker has claimed the run yet, write its
    end (`cancelled`), which a worker started later respects. False when
    the run folder is gone or a worker got there first."""
    if not os.path.isdir(run_dir):
        return False
    with start_lock(run_dir):
        if read_status(run_dir) is not None:
            return False
        write_json_atomic(os.path.join(run_dir, STATUS_FILE), {
            "version": runfiles.STATUS_VERSION, "state": "cancelled",
            "message": "cancelled before the command started",
            "exit_code": None, "started_at": None, "ended_at": now_iso()})
        return True


def remove(run_dir: str) -> dict[str, Any]:
    """Cancel the run, then remove its folder; kept while processes of the
    run that would not stop are alive (its status is how they are found)."""
    answer = cancel(run_dir, CANCEL_WAIT_SECONDS)
    if answer.get("left"):
        return {"removed": False, "reason": answer["reason"]}
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"removed": not os.path.exists(run_dir)}


def watchdog(run_dir: str, seconds: float, poweroff: bool = False) -> dict[str, Any]:
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
    remove(run_dir)
    if poweroff:
        argv = ["shutdown", "-h", "now"] if os.geteuid() == 0 else ["sudo", "-n", "shutdown", "-h", "now"]
        with contextlib.suppress(OSError):
            subprocess.call(argv)
    return {"fired": True}


def daemon(work: Callable[[int], int]) -> bytes:
    """Run `work(ready_fd)` in a child of a session of its own, stdin and
    stdout on /dev/null (its stderr is for `work` to redirect), so that it
    outlives the caller and its SSH session. Returns what the child writes
    to `ready_fd` once it is under way (b"" if it died first)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        answer = os.read(ready_r, 1 << 16)  # one short write, or the end if the child died
        os.close(ready_r)
        os.waitpid(pid, os.WNOHANG)  # reaped if it died; else init's once we exit
        return answer
    code = 1
    try:
        os.close(ready_r)
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        code = work(ready_w)
    except BaseException:  # to the stderr `work` chose (the worker's: the run's log)
        traceback.print_exc()
    finally:
        os._exit(code)


def detach_watchdog(run_dir: str, seconds: float, poweroff: bool) -> dict[str, Any]:
    """Start the watchdog as a daemon; its record (watchdog.json) once armed."""

    def arm(ready: int) -> int:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        armed = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "seconds": seconds,
                 "armed_at": time.time()}
        write_json_atomic(os.path.join(run_dir, "watchdog.json"), armed)
        os.write(ready, json.dumps(armed).encode())
        os.close(ready)
        watchdog(run_dir, seconds, poweroff)
        return 0

    answer = daemon(arm)
    return json.loads(answer) if answer else {"pid": None, "error": "watchdog did not start"}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        sys.stderr.write(__doc__ or "")
        return 2
    command, run_dir = args[0], args[1]
    if command == "follow" and len(args) >= 4:
        return follow(run_dir, int(args[2]), int(args[3]))
    result: Mapping[str, Any]
    if command == "status":
        result = status(run_dir)
    elif command == "cancel":
        wait = float(args[args.index("--wait") + 1]) if "--wait" in args else CANCEL_WAIT_SECONDS
        result = cancel(run_dir, wait)
    elif command == "remove":
        result = remove(run_dir)
    elif command == "watchdog" and len(args) >= 3:  # armed as a daemon: the caller's session may end
        os.makedirs(run_dir, exist_ok=True)
        result = detach_watchdog(run_dir, float(args[2]), "--poweroff" in args)
    else:
        sys.stderr.write("unknown command: %s\n" % " ".join(args))
        return 2
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
