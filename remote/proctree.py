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
from typing import Callable, Dict, List, Optional, Set, Tuple

PR_SET_CHILD_SUBREAPER = 36
REAP_SECONDS = 5.0  # how long SIGKILLed processes may take to disappear

Sleep = Callable[[float], None]  # the worker's sleep, which a signal cuts short
Reaped = List[Tuple[int, int]]  # [(pid, raw wait status)]


def become_subreaper() -> bool:
    """Orphans below this process are reparented to it rather than to init."""
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def process_table() -> Dict[int, Tuple[int, str]]:
    """pid -> (ppid, state) for every process we can see."""
    table = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue  # it exited while we looked
        fields = raw[raw.rfind(")") + 2 :].split()
        table[int(name)] = (int(fields[1]), fields[0])
    return table


def live_descendants(root_pid: int, table: Optional[Dict[int, Tuple[int, str]]] = None) -> List[int]:
    """Every live (non-zombie) descendant of root_pid, parents first."""
    table = process_table() if table is None else table
    children: Dict[int, List[int]] = {}
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


def with_children(pid: int) -> Set[int]:
    """pid and its direct children (bubblewrap's outer and inner process)."""
    return {pid} | {child for child, (ppid, _s) in process_table().items() if ppid == pid}


def signal_pids(pids: List[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):  # already gone
            os.kill(pid, sig)


def reap_children() -> Reaped:
    """Collect every exited child."""
    reaped: Reaped = []
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, raw))


def code_of(pid: int, reaped: Reaped) -> Optional[int]:
    """pid's exit code if it is among the reaped; -N for death by signal N."""
    for reaped_pid, raw in reaped:
        if reaped_pid == pid:
            return -os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)
    return None


def make_cgroup(name: str, stale: Callable[[str], bool] = lambda _name: False) -> Optional[str]:
    """A cgroup v2 of its own for the command, below the worker's: ended
    whole with `cgroup.kill`, which no fork can outrun. None where none can
    be made (no cgroup v2, a kernel before 5.14, no right to make one: an
    unprivileged user without a delegated subtree, most containers).
    Its siblings named `substrax-*` that `stale` says are no live worker's
    are removed if empty (the kernel refuses to remove one that is not)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        with open("/proc/self/cgroup") as f:
            own = [line.strip()[3:] for line in f if line.startswith("0::")]
    except OSError:
        return None
    # mountinfo: "id parent dev root mount-point options ... - fstype source"
    roots = [m[4] for m in mounts if "-" in m and m[m.index("-") + 1 :][:1] == ["cgroup2"]]
    if not roots or not own:
        return None
    parent = os.path.join(roots[0], own[0].lstrip("/"))
    with contextlib.suppress(OSError):
        for sibling in os.listdir(parent):
            if sibling.startswith("substrax-") and sibling != name and stale(sibling):
                remove_cgroup(os.path.join(parent, sibling))
    path = os.path.join(parent, name)
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


def cgroup_pids(path: Optional[str]) -> List[int]:
    if path is None:
        return []
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:  # gone
        return []


def remove_cgroup(path: str) -> None:
    with contextlib.suppress(OSError):  # gone, or not empty yet: left to the system
        os.rmdir(path)


def kill_all(seconds: float, sleep: Sleep, group: Optional[int] = None, cgroup: Optional[str] = None
             ) -> Reaped:
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
    reaped: Reaped = []
    deadline = time.monotonic() + seconds
    stopped: Set[int] = set()
    if cgroup is not None:
        with contextlib.suppress(OSError), open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
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
        if not (alive or cgroup_pids(cgroup)) or time.monotonic() >= deadline:
            return reaped + reap_children()
        sleep(0.01)


def wait_tree(child_pid: int, seconds: float, sleep: Sleep, cgroup: Optional[str] = None
              ) -> Tuple[Optional[int], List[int]]:
    """Reap for up to `seconds` until the command and all below it are gone:
    (the command's exit code if it was reaped, the live descendants left).
    Also how a finished command's exiting helpers are waited for: when
    bubblewrap's outer process ends first, its inner one is reparented to
    us while it is still exiting, and is no leftover of the command."""
    code = None
    deadline = time.monotonic() + seconds
    while True:
        found = code_of(child_pid, reap_children())
        code = code if found is None else found
        alive = sorted(set(live_descendants(os.getpid())) | set(cgroup_pids(cgroup)))
        if not alive or time.monotonic() >= deadline:
            return code, alive
        sleep(0.01)
