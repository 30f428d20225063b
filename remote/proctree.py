"""The worker's process tree: who is below it, and how to end them all.

Stdlib only, Python 3.8+, Linux (it reads /proc); shipped beside worker.py.
The worker is a child subreaper, so every descendant, even one that
double-forked and called ``setsid``, stays below it and is found here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import Callable

PR_SET_CHILD_SUBREAPER = 36
REAP_SECONDS = 5.0  # how long SIGKILLed processes may take to disappear

Sleep = Callable[[float], None]  # the worker's sleep, which a signal cuts short


def become_subreaper() -> bool:
    """Orphans below this process are reparented to it rather than to init."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process we can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue  # it exited while we looked
        fields = raw[raw.rfind(")") + 2 :].split()
        table[int(name)] = (int(fields[1]), fields[0])
    return table


def live_descendants(root_pid: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    """Every live (non-zombie) descendant of root_pid, parents first."""
    if table is None:
        table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = []
    stack = list(children.get(root_pid, []))
    while stack:
        pid = stack.pop()
        if table[pid][1] != "Z":
            found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def with_children(pid: int) -> set[int]:
    """pid and its direct children (bubblewrap's outer and inner process)."""
    return {pid} | {child for child, (ppid, _s) in process_table().items() if ppid == pid}


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, sig)


def reap_children() -> list[tuple[int, int]]:
    """Collect every exited child; returns [(pid, raw wait status)]."""
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, raw))


def code_of(pid: int, reaped: list[tuple[int, int]]) -> int | None:
    """pid's exit code if it is among the reaped; -N for death by signal N."""
    for reaped_pid, raw in reaped:
        if reaped_pid == pid:
            return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
    return None


def make_cgroup(name: str) -> str | None:
    """A cgroup v2 of its own for the command, below the worker's: ended
    whole with `cgroup.kill`, which no fork can outrun. None where none can
    be made (no cgroup v2, a kernel before 5.14, no right to make one: an
    unprivileged user without a delegated subtree, most containers)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:
            own = [line.strip()[3:] for line in f if line.startswith("0::")]
    except OSError:
        return None
    # mountinfo: "id parent dev root mount-point options ... - fstype source"
    roots = [m[4] for m in mounts if "-" in m and m[m.index("-") + 1 :][:1] == ["cgroup2"]]
    root = roots[0] if roots else None
    if root is None or not own:
        return None
    path = os.path.join(root, own[0].lstrip("/"), name)
    try:
        os.mkdir(path, 0o755)
    except OSError:
        return None
    if not os.path.exists(os.path.join(path, "cgroup.kill")):
        remove_cgroup(path)
        return None
    return path


def join_cgroup(path: str) -> None:
    """Move the calling process into `path` (the command, before exec)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("0")


def cgroup_pids(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:
        return []


def remove_cgroup(path: str) -> None:
    with contextlib.suppress(OSError):  # gone, or not empty yet: left to the system
        os.rmdir(path)


def kill_all(seconds: float, sleep: Sleep, group: int | None = None, cgroup: str | None = None
             ) -> list[tuple[int, int]]:
    """SIGKILL every descendant of this process until none is left (or
    `seconds` pass); reap them all.

    A process that keeps forking and exiting (each child forks again before
    its parent's SIGKILL lands) stays one step ahead of a kill loop that
    reads /proc. So: the command's cgroup, where there is one, is killed as
    a whole; the command's process group (`group`, its pid: it was started
    in a session of its own) gets SIGKILL as a group, which no fork in it
    escapes. Descendants that left that group are stopped first (SIGSTOP
    cannot be caught, and a stopped process cannot fork) until a look finds
    none running that was not stopped already, then killed."""
    reaped: list[tuple[int, int]] = []
    deadline = time.monotonic() + seconds
    stopped: set[int] = set()
    if cgroup is not None:
        with contextlib.suppress(OSError):
            with open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
                f.write("1")
    while True:
        if group is not None:
            # Our group's id cannot name another group while any process of
            # ours is in it (the kernel does not reuse it); once it is empty
            # this finds no one, unless the pid went round in the few
            # seconds this loop lasts.
            with contextlib.suppress(OSError):
                os.killpg(group, signal.SIGKILL)
        table = process_table()
        alive = live_descendants(os.getpid(), table)
        running = [pid for pid in alive if table[pid][1] not in ("T", "t") and pid not in stopped]
        if running and time.monotonic() < deadline:
            signal_pids(running, signal.SIGSTOP)
            stopped.update(running)
            continue
        signal_pids(alive, signal.SIGKILL)
        reaped.extend(reap_children())
        left = alive or (cgroup is not None and cgroup_pids(cgroup))
        if not left or time.monotonic() >= deadline:
            break
        sleep(0.01)
    reaped.extend(reap_children())
    return reaped


def stop_tree(child_pid: int, grace: float, spared: set[int], sleep: Sleep, cgroup: str | None = None
              ) -> int | None:
    """SIGTERM every descendant but `spared`, wait up to `grace` for them to
    go, then SIGKILL and reap what is left. The command's exit code if it
    was reaped."""
    me = os.getpid()
    signal_pids([p for p in live_descendants(me) if p not in spared], signal.SIGTERM)
    code = None
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        found = code_of(child_pid, reap_children())
        code = code if found is None else found
        if code is not None and not live_descendants(me) and not (cgroup and cgroup_pids(cgroup)):
            return code
        sleep(0.02)
    found = code_of(child_pid, kill_all(REAP_SECONDS, sleep, child_pid, cgroup))
    return code if found is None else found


def settle(seconds: float, sleep: Sleep) -> list[int]:
    """Live descendants left once those already exiting are gone: when
    bubblewrap's outer process ends first, its inner one is reparented to
    us while it is still exiting, and is no leftover of the command."""
    deadline = time.monotonic() + seconds
    while True:
        reap_children()
        alive = live_descendants(os.getpid())
        if not alive or time.monotonic() >= deadline:
            reap_children()  # those that turned zombie since
            return alive
        sleep(0.01)
