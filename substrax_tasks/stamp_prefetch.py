"""The steps' output stamps, walked ahead of their checks by a forked child.

A no-op `doit` spends most of its extra time on one `lstat` per output file
of every step (the floor of a check that sees an edit in place). Those
walks do not depend on each other, and a machine has more than one core:
at the first check of a doit run, this process forks a child that walks
the outputs of the declared steps from the last to the first, and sends
each stamp (the digest of the walk, the newest ctime it saw) through a
pipe. Each check takes the stamp of its step if it has arrived and walks
in line otherwise, so the two meet in the middle. git's `core.preloadIndex`
does the same for its index (threads there; a Python walk holds the GIL).

What a stamp may be used for: a stamp says what the outputs were when the
child walked them. It stands for "now" only while nothing could have
changed them since, so a check uses it only if no task that doit may run
before asking it (its task_dep, calc_dep and setup tasks, transitively)
has executed; otherwise, and for any stamp not there yet, the check walks
in line. A proof is still only kept after an in-line walk agrees with it
(chain.StepRunner.up_to_date).

When the child is used at all: Linux (fork, pidfd, /proc), more than one
step to walk, and no other thread in this process at the first check (a
fork with other threads running can deadlock the child; doit starts the
threads of `-P thread` and the processes of `-P process` after that
check). The child closes every inherited descriptor but its pipe, and
ends on its own once it has walked every step or this process is gone;
this process kills it (by its pidfd) and reaps it when every stamp is
taken, when a check finds a task before it executed, at the next doit run
in the process, and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import signal
import struct
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from substrax_tasks import manifest_cache

# index of the step, the digest of its outputs' walk, the newest ctime seen
_RECORD = struct.Struct("<I32sq")
_READ_SIZE = 1 << 16


class OutputsJob:
    """What the child walks for one step: its project root and outputs, in
    the slot of its step."""

    __slots__ = ("outputs", "root", "slot")

    def __init__(self, root: str, outputs: list[str], slot: int) -> None:
        self.root = root
        self.outputs = outputs
        self.slot = slot


_JOBS: list[OutputsJob] = []
_SLOTS: dict[tuple[str, str], int] = {}
_LOCK = threading.Lock()


def register(root: str, step: str, outputs: list[str]) -> OutputsJob:
    """A step's job, in the slot of its (project, name): a dodo loaded again
    in one process reuses its slots (each job is its own: a stamp walked
    for another job of the slot is never taken)."""
    with _LOCK:
        slot = _SLOTS.setdefault((root, step), len(_JOBS))
        job = OutputsJob(root, outputs, slot)
        if slot == len(_JOBS):
            _JOBS.append(job)
        else:
            _JOBS[slot] = job
        return job


def walk(root: str, outputs: list[str]) -> tuple[bytes, int]:
    """The stamp of `outputs` under `root`: the digest of one stat-only
    walk (manifest.stat_walk) and the newest ctime it saw. ManifestError
    for refused paths."""
    mod = manifest_cache.manifest_module()
    items: list[Any] = []
    newest = mod.stat_walk(root, outputs, items)
    return bytes.fromhex(mod.stamp_of(items)), newest


class _Prefetch:
    """One child's walk, for one doit run."""

    def __init__(self, jobs: list[OutputsJob], pid: int, pidfd: int, read_fd: int, claims: mmap.mmap) -> None:
        self.jobs = jobs  # as the child has them
        self.pid = pid
        self.pidfd = pidfd
        self.read_fd = read_fd
        self.claims = claims
        self.remaining = len(claims)
        self.stamps: dict[int, tuple[bytes, int]] = {}
        self.partial = b""
        self.closed = False
        self.used = 0  # stamps of the child's that a check took

    def take(self, job: OutputsJob) -> tuple[bytes, int] | None:
        """The child's stamp for `job` if it has arrived (once); else its
        slot is claimed, so the child skips it, and None."""
        slot = job.slot
        if slot >= len(self.jobs) or self.jobs[slot] is not job or self.claims[slot]:
            return None
        self.claims[slot] = 1
        self.remaining -= 1
        self._drain()
        found = self.stamps.pop(slot, None)
        self.used += found is not None
        if self.remaining == 0:
            self.close()
        return found

    def _drain(self) -> None:
        data = self.partial
        with contextlib.suppress(BlockingIOError):
            while True:
                chunk = os.read(self.read_fd, _READ_SIZE)
                if not chunk:
                    break
                data += chunk
        whole = len(data) - len(data) % _RECORD.size
        for slot, digest, newest in _RECORD.iter_unpack(data[:whole]):
            self.stamps[slot] = (digest, newest)
        self.partial = data[whole:]

    def close(self) -> None:
        """Kill the child (by its pidfd: never another process that reused
        its pid) and reap it."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        os.close(self.pidfd)
        os.close(self.read_fd)
        self.claims.close()
        self.stamps.clear()


_CURRENT: _Prefetch | None = None


def _no_run() -> Any:
    return None


_DECIDED_FOR: Callable[[], Any] = _no_run  # (a reference to) the doit run _CURRENT was decided for
_EXIT_REGISTERED = False


def outputs_stamp(job: OutputsJob, task: Any, doit_state: tuple[Any, Any] | None) -> tuple[bytes, int]:
    """The stamp of a step's outputs: the child's when it may be used (see
    the module's text), else walked now. `task` and `doit_state` are doit's
    task and (dependency manager, tasks dict) of the check; without them
    (`why`, a phase deciding on its own) it is always walked now."""
    if doit_state is not None and task is not None:
        found = _prefetched(job, task, doit_state)
        if found is not None:
            return found
    return walk(job.root, job.outputs)


def _prefetched(job: OutputsJob, task: Any, doit_state: tuple[Any, Any]) -> tuple[bytes, int] | None:
    global _CURRENT, _DECIDED_FOR
    dep_manager, tasks = doit_state
    if _DECIDED_FOR() is not dep_manager:
        # the first check of a doit run (another run may have gone before
        # it in this process: its child is stopped); decided once a run
        if _CURRENT is not None:
            _CURRENT.close()
        _CURRENT = _start()
        # weak: a finished run is not kept alive by it
        _DECIDED_FOR = weakref.ref(dep_manager)
    current = _CURRENT
    if current is None or current.closed:
        return None
    if _ran_before(task, tasks):
        current.close()  # tasks are running: from now on, every check walks in line
        return None
    return current.take(job)


def _ran_before(task: Any, tasks: Any) -> bool:
    """Whether a task doit may have run before asking `task` (its task_dep,
    calc_dep and setup tasks, all the way up) has executed in this process."""
    seen: set[str] = set()
    todo = [*task.task_dep, *task.calc_dep, *task.setup_tasks]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        dep = tasks.get(name)
        if dep is None:
            continue
        if dep.executed:
            return True
        todo += dep.task_dep
        todo += dep.calc_dep
        todo += dep.setup_tasks
    return False


def _single_threaded() -> bool:
    """No thread at all besides this one, Python's or a library's own."""
    try:
        return len(list(Path("/proc/self/task").iterdir())) == 1
    except OSError:
        return False


def _start() -> _Prefetch | None:
    """Fork the child, or None where it is not worth it or not safe."""
    global _EXIT_REGISTERED
    if len(_JOBS) < 2 or sys.platform != "linux" or threading.active_count() != 1 or not _single_threaded():
        return None
    jobs = list(_JOBS)
    claims = mmap.mmap(-1, len(jobs))  # shared with the child: the slots taken here
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:  # no memory or process left for it: the checks walk in line
        os.close(read_fd)
        os.close(write_fd)
        claims.close()
        return None
    if pid == 0:  # the child: never returns
        _child(jobs, claims, write_fd)
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        # Not reaped by anyone yet, so the pid is still the child's.
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_fd)
        claims.close()
        return None
    if not _EXIT_REGISTERED:
        _EXIT_REGISTERED = True
        atexit.register(_close_current)
    return _Prefetch(jobs, pid, pidfd, read_fd, claims)


def _close_current() -> None:
    if _CURRENT is not None:
        _CURRENT.close()


def _child(jobs: list[OutputsJob], claims: mmap.mmap, write_fd: int) -> None:
    """Walk the steps from the last, sending each stamp; exit, whatever
    happens (no atexit handler, no flush of the parent's buffers)."""
    status = 1
    try:
        # Nothing inherited held open (a pipe another process waits on the
        # end of, doit's stdout): /dev/null for 0-2, every other one closed.
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, write_fd)
        os.closerange(write_fd + 1, 1 << 20)
        parent = os.getppid()
        for slot in range(len(jobs) - 1, -1, -1):
            if claims[slot]:
                continue  # walked by the parent
            if os.getppid() != parent:
                break  # the parent is gone
            job = jobs[slot]
            try:
                digest, newest = walk(job.root, job.outputs)
            except Exception:  # noqa: BLE001, S112 - refused paths: the parent's own walk reports them
                continue
            os.write(write_fd, _RECORD.pack(slot, digest, newest))
        status = 0
    finally:
        os._exit(status)
