#!/usr/bin/env python3
"""A SkyPilot cluster's lease: the one SkyPilot job that holds the cluster.

Stdlib only, Python 3.8+. Steps run on a SkyPilot cluster through the
worker over ssh, as on an ssh host, not as SkyPilot jobs; but SkyPilot
counts a cluster idle when its job queue is empty, and its autodown then
takes it down. So the cluster's launch submits one job, this lease: it runs
while any step's run on the cluster goes, and exits IDLE_SECONDS after the
last one ended with none going, whether or not a client is still there.
SkyPilot's autodown, armed with a short idle at launch, then takes the
cluster down.

    python3 lease.py hold ROOT CLUSTER IDLE_SECONDS   the SkyPilot job's run (foreground)
    python3 lease.py home ROOT CLUSTER                the cluster's setup: say its job's home (below)
    python3 lease.py claim ROOT CLUSTER RUN_ID        a client, before it gives the cluster a step
    python3 lease.py status ROOT CLUSTER              the lease's record, whether it holds, idle left

ROOT is remote_root there: runs in ROOT/runs/<run-id>/ (control.py's status
files), the lease's own files in ROOT/leases/CLUSTER/ (lease.json,
lease.lock): named by the cluster, since clusters whose homes share a file
system (a Slurm site's) may share ROOT; a run counts for the lease its
claim names. The lifetime watchdog, armed on that folder before the
cluster's setup, removes it when the lifetime ends: the lease then exits.

A relative ROOT is relative to the home the lease's SkyPilot job runs in,
which need not be where ssh lands (on Slurm the job's is a folder of the
cluster's own, ssh lands in the login's). So the cluster's setup, as it
begins, writes that home to ROOT/job-homes/CLUSTER under the login's home
(the password database's, where ssh lands): a client's first ssh call
reads it there (backends/skypilot/task.py, in_job_home) instead of asking
SkyPilot for the job's log. The lease removes it as it ends.

The handshake, and why no step is given to a lease that ends (the race
analysis). Both sides decide under one lock, ROOT/lease/lease.lock (flock):
- `claim` takes the lock, reads lease.json: only a lease that says `held`
  and whose process is alive is claimed; it then makes the run's folder
  with a `lease-claim` file naming the cluster in it, and lets the lock go.
- `hold` takes the lock for each of its decisions: it lists the runs that
  go (a claim with no status yet, or a status whose worker or command tree
  is alive); if none goes and it has been idle for IDLE_SECONDS, it writes
  `ended` into lease.json before it lets the lock go, then exits.
So a claim either comes before the lease's last decision, and that decision
sees the claimed run (the lease goes on), or after it, and reads `ended`
(or a dead lease) and refuses: no step can start on a cluster whose lease
has decided to end, and a step started in the lease's last instant is seen.
A claim whose client never starts the run (killed between claim and start)
holds the lease for at most CLAIM_HOLD_SECONDS from its last touch; the
lifetime bounds the cluster whatever happens.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import signal
import sys
import time
from typing import Any, Dict, Iterator, List, Optional

PACKAGED = bool(__package__)
if PACKAGED:
    from . import control, runfiles
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run isolated (python3 -I), as control.py
    import control
    import runfiles

LEASES_DIR = "leases"
JOB_HOMES_DIR = "job-homes"
RECORD = "lease.json"
LOCK = "lease.lock"
CLAIM = "lease-claim"  # in a run's folder: a client gave the run this cluster
POLL_SECONDS = 1.0
# A claimed run with no status yet (its client syncs files, builds the
# environment) holds the lease this long from the claim's last touch.
CLAIM_HOLD_SECONDS = 1800.0


def lease_dir(root: str, cluster: str) -> str:
    return os.path.join(root, LEASES_DIR, cluster)


def job_home_file(root: str, cluster: str) -> str:
    """Where the lease of a relative ROOT says its job's home: under the login's home."""
    return os.path.join(pwd.getpwuid(os.getuid()).pw_dir, root, JOB_HOMES_DIR, cluster)


def say_home(root: str, cluster: str) -> int:
    """`home`: the job's home written where ssh lands, or why not (the
    client then reads it from the job's log, where the setup printed it):
    never a failed setup for it."""
    if os.path.isabs(root):
        return 0
    path = job_home_file(root, cluster)
    try:
        write_job_home(path)
    except OSError as exc:
        sys.stdout.write("substrax lease: could not write %s: %s\n" % (path, exc))
    return 0


def write_job_home(path: str) -> None:
    """The job's home (the lease's working folder) written where ssh lands,
    this cluster's file only. The folder may be shared: on a Slurm site the
    login's home is every node's, and other clusters (of this client or of
    others) write theirs there. Nothing here proves another's file stale:
    a `.tmp` is another setup's write in progress, and a home that is not a
    folder here may be another node's local one. So none is removed; a
    lease removes its own as it ends (remove_job_home), and one killed
    outright leaves a file of one line, which names no live cluster."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "w") as f:
        f.write(os.getcwd() + "\n")
    os.replace(tmp, path)


def remove_job_home(path: Optional[str]) -> None:
    """The lease's home file gone with it (if still its own: a lease of a
    cluster launched again under the same name writes its own)."""
    if path is None:
        return
    with contextlib.suppress(OSError):
        with open(path) as f:
            if f.read().strip() != os.getcwd():
                return
        os.unlink(path)


@contextlib.contextmanager
def locked(folder: str) -> Iterator[None]:
    fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_record(folder: str) -> Optional[Dict[str, Any]]:
    return control.read_json(os.path.join(folder, RECORD))


def holds(record: Optional[Dict[str, Any]]) -> bool:
    """Whether the lease of `record` holds the cluster: it says so and its process is alive."""
    return (record is not None and record.get("state") == "held"
            and control.alive(record.get("pid"), record.get("start_ticks")))


def claimed_for(run_dir: str) -> Optional[str]:
    """The cluster the run in `run_dir` was given by a claim, if any."""
    try:
        with open(os.path.join(run_dir, CLAIM)) as f:
            return f.read().strip()
    except OSError:
        return None


def going(run_dir: str, cluster: str, now: float) -> bool:
    """Whether the run in `run_dir`, claimed for `cluster`, goes: its
    worker or its command's tree is alive, or it has no status yet and its
    claim is fresh."""
    claim = os.path.join(run_dir, CLAIM)
    if claimed_for(run_dir) != cluster:
        return False  # another cluster's run, or one not given a cluster by a claim
    if control.read_status(run_dir) is None:
        try:
            return now - os.stat(claim).st_mtime < CLAIM_HOLD_SECONDS
        except OSError:
            return False
    return control.tree_alive(run_dir)


def runs_going(root: str, cluster: str, now: float) -> List[str]:
    runs = os.path.join(root, "runs")
    try:
        names = sorted(os.listdir(runs))
    except OSError:
        return []
    return [name for name in names if going(os.path.join(runs, name), cluster, now)]


def last_end(root: str, cluster: str) -> float:
    """When the cluster's last run's status was written (a run too short
    for a poll to see going)."""
    newest = 0.0
    runs = os.path.join(root, "runs")
    with contextlib.suppress(OSError):
        for name in os.listdir(runs):
            if claimed_for(os.path.join(runs, name)) == cluster:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.stat(os.path.join(runs, name, control.STATUS_FILE)).st_mtime)
    return newest


def write_record(folder: str, record: Dict[str, Any]) -> None:
    control.write_json_atomic(os.path.join(folder, RECORD), record)


def hold(root: str, cluster: str, idle_seconds: float) -> int:
    """The lease: until idle_seconds after the last run ended with none
    going, or until its folder is removed (the lifetime ended); the home
    file its setup wrote (a relative ROOT) removed as it ends, or as
    SkyPilot stops its job (SIGTERM)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    home_file = None if os.path.isabs(root) else job_home_file(root, cluster)
    try:
        return _hold(root, cluster, idle_seconds)
    finally:
        remove_job_home(home_file)


def _hold(root: str, cluster: str, idle_seconds: float) -> int:
    folder = lease_dir(root, cluster)
    os.makedirs(folder, exist_ok=True)
    pid = os.getpid()
    record: Dict[str, Any] = {
        "version": runfiles.STATUS_VERSION, "state": "held", "pid": pid,
        "start_ticks": control.start_ticks(pid), "started_at": time.time(),
        "idle_seconds": idle_seconds, "busy": [], "idle_since": time.time(),
    }
    with locked(folder):
        write_record(folder, record)
    sys.stdout.write("substrax lease: holding the cluster until %gs after its last step\n" % idle_seconds)
    sys.stdout.flush()
    last_active = time.time()
    while True:
        time.sleep(POLL_SECONDS)
        if not os.path.isdir(folder):
            sys.stdout.write("substrax lease: the cluster's lifetime ended\n")
            return 0
        with locked(folder):
            now = time.time()
            busy = runs_going(root, cluster, now)
            if busy:
                last_active = now
            idle_since = max(last_active, last_end(root, cluster))
            if not busy and now - idle_since >= idle_seconds:
                write_record(folder, dict(record, state="ended", busy=[], ended_at=now))
                sys.stdout.write("substrax lease: idle for %gs, ended\n" % idle_seconds)
                return 0
            changed = dict(record, busy=busy, idle_since=None if busy else idle_since)
            if changed != record:  # written on a change only: a step starting or ending
                record = changed
                write_record(folder, record)


def claim(root: str, cluster: str, run_id: str) -> Dict[str, Any]:
    """Give run `run_id` the cluster, if its lease holds it (see the
    module's docstring); touched again by the same run, it keeps the claim fresh."""
    folder = lease_dir(root, cluster)
    if not os.path.isdir(folder):
        return {"claimed": False, "reason": "no lease on this cluster (its setup has not ended, "
                "or its lifetime has)", "state": None}
    with locked(folder):
        record = read_record(folder)
        if record is None:
            return {"claimed": False, "reason": "its lease has not started", "state": None}
        if not holds(record):
            return {"claimed": False, "reason": "its lease has ended", "state": "ended"}
        run_dir = os.path.join(root, "runs", run_id)
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        with open(os.path.join(run_dir, CLAIM), "w") as f:
            f.write(cluster + "\n")
        answer = {"claimed": True, "state": "held", "started_at": record.get("started_at")}
        if not os.path.isabs(root):  # the client learns the home its paths are relative to
            answer["job_home"] = os.getcwd()
        return answer


def status(root: str, cluster: str) -> Dict[str, Any]:
    record = read_record(lease_dir(root, cluster)) or {}
    held = holds(record)
    idle_since = record.get("idle_since")
    idle_left = None
    if held and isinstance(idle_since, (int, float)):
        idle_left = max(0.0, float(idle_since) + float(record.get("idle_seconds") or 0) - time.time())
    state = "held" if held else ("ended" if record else None)
    return {"state": state, "busy": record.get("busy") or [], "idle_left": idle_left,
            "started_at": record.get("started_at")}


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 4 and args[0] == "hold":
        return hold(args[1], args[2], float(args[3]))
    if len(args) == 3 and args[0] == "home":
        return say_home(args[1], args[2])
    if len(args) == 4 and args[0] == "claim":
        answer = claim(args[1], args[2], args[3])
    elif len(args) == 3 and args[0] == "status":
        answer = status(args[1], args[2])
    else:
        sys.stderr.write(__doc__ or "")
        return 2
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
