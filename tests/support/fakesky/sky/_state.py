"""The fake's state under $HOME/.fakesky/ and the processes it starts.

    requests/<id>/request.json  name, status, pid + start time, timestamps
    requests/<id>/args.json     the call's arguments (mode 0600: secrets)
    requests/<id>/result.json   {"ok": true, "result": ...} or the exception
    requests/<id>/log           the request's output (stream_and_get)
    clusters/<name>/cluster.json, home/, jobs/<id>.json, jobs/<id>.log
    procs/<pid>-<ticks>.json    every process the fake started
    cluster-ids                 every cluster incarnation (environment marker)
    locks/                      flock files

Every process the fake starts is a session leader recorded by pid and
/proc start time; job processes also carry FAKESKY_CLUSTER_ID=<id> in their
environment, which finds what a job double-forked out of its session when
the cluster is downed (its "VM" is gone). `cleanup(home)` stops them all.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FAKE_ROOT = Path(__file__).resolve().parent.parent  # holds the `sky` package
MARKER = "FAKESKY_CLUSTER_ID"


def state_dir(home: Path | None = None) -> Path:
    return (home if home is not None else Path.home()) / ".fakesky"


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


# ------------------------------------------------------------------- files


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Atomically: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    partial.replace(path)


@contextlib.contextmanager
def locked(state: Path, name: str) -> Iterator[None]:
    """An exclusive flock, held briefly around each read-modify-write."""
    folder = state / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{name}.lock").open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------- processes


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (zombies too); None if gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def alive(pid: int | None, ticks: int | None) -> bool:
    """`pid` is still the process that started at `ticks`, and not a zombie."""
    if not pid or ticks is None:
        return False
    fields = _stat(pid)
    return fields is not None and int(fields[19]) == ticks and fields[0] not in ("Z", "X")


def group_members(pgid: int, ticks: int | None) -> list[int]:
    """Live processes of the group `pgid` led by the process started at
    `ticks`. A pgid is not reused while any member lives; if the pid now
    belongs to another process, the group is gone."""
    now = start_ticks(pgid)
    if now is not None and now != ticks:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == pgid:
                found.append(int(entry))
    return found


def marked(marker: str) -> list[int]:
    """Live processes whose environment holds FAKESKY_CLUSTER_ID=<marker>."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        fields = _stat(int(entry))
        if needle in environ.split(b"\0") and fields is not None and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def sessions_serving(marker: str) -> list[tuple[int, int]]:
    """The sshd connections (pid, start ticks) that marked processes run
    under: the per-connection sshd processes above them, not the listening
    daemon (the topmost sshd). Closing them drops a client's connection to
    the cluster, as the cluster's machine going away does."""
    found = set()
    for pid in marked(marker):
        chain = []
        parent = _parent(pid)
        while parent is not None and _comm(parent) == "sshd":
            chain.append(parent)
            parent = _parent(parent)
        found.update(chain[:-1])  # the last is the listener
    return [(pid, ticks) for pid in found if (ticks := start_ticks(pid)) is not None]


def _parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields is not None and int(fields[1]) > 1 else None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_group(pid: int | None, ticks: int | None, grace: float) -> None:
    """SIGTERM the process group `pid` leads, SIGKILL what is left after
    `grace` seconds; return once it is empty."""
    if not pid or not group_members(pid, ticks):
        return
    if grace > 0:
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while group_members(pid, ticks) and time.monotonic() < deadline:
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while group_members(pid, ticks) and time.monotonic() < deadline:
        _signal_group(pid, signal.SIGKILL)
        time.sleep(0.02)


def kill_marked(marker: str) -> None:
    """SIGKILL every process carrying the cluster's marker, until none is left."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = marked(marker)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def spawn(state: Path, role: str, args: list[str], *, env: dict[str, str] | None = None,
          log: Path | None = None) -> tuple[int, int]:  # fmt: skip
    """`python -m sky ROLE STATE ARGS...` (sky._server), detached: its own session,
    not waited for. Recorded under procs/ before this returns."""
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(FAKE_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(FAKE_ROOT), *paths])
    argv = [sys.executable, "-m", "sky", role, str(state), *args]
    out = log.open("ab") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=state, start_new_session=True,
        )  # fmt: skip
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]
    ticks = start_ticks(proc.pid)
    assert ticks is not None  # our unreaped child: at worst a zombie
    record_process(state, proc.pid, ticks, role, args)
    # Detached: never waited for here (it ends as a zombie until this process
    # exits, which is short-lived); this keeps Popen.__del__ from warning.
    proc.returncode = 0
    return proc.pid, ticks


def own_ticks() -> int:
    ticks = start_ticks(os.getpid())
    assert ticks is not None
    return ticks


def record_process(state: Path, pid: int, ticks: int, role: str, args: list[str]) -> None:
    write_json(state / "procs" / f"{pid}-{ticks}.json",
               {"pid": pid, "ticks": ticks, "role": role, "args": args})  # fmt: skip


def remember_cluster_id(state: Path, cluster_id: str) -> None:
    state.mkdir(parents=True, exist_ok=True)
    with (state / "cluster-ids").open("a") as f:
        f.write(cluster_id + "\n")


def cleanup(home: Path | None = None) -> list[str]:
    """Stop every process the fake started under `home` (default: $HOME):
    request workers, job runners (their whole process groups), autostop
    timers, and anything still carrying a cluster's marker. By pid, SIGKILL.
    Returns what it stopped, for the caller's report."""
    state = state_dir(home)
    stopped = []
    for path in sorted((state / "procs").glob("*.json")):
        record = read_json(path) or {}
        pid, ticks = record.get("pid"), record.get("ticks")
        if pid and group_members(pid, ticks):
            stopped.append(f"{pid} {record.get('role')} {' '.join(record.get('args', []))}")
            stop_group(pid, ticks, grace=0)
    ids = state / "cluster-ids"
    for marker in set(ids.read_text().split()) if ids.exists() else ():
        left = marked(marker)
        if left:
            stopped.append(f"{left} with {MARKER}={marker}")
            kill_marked(marker)
    return stopped
