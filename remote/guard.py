"""A run's guard: what outlives its worker, so that its command never
outlives its deadline.

Stdlib only, Python 3.8+; shipped beside worker.py, which starts it.

The worker ends its command's tree at the job's timeout, which a cost cap
brings forward (backends/job.py). A worker that is killed (kill -9, the
OOM killer) ends nothing: under bubblewrap the sandbox dies with it
(--die-with-parent), but without one the command would run on, unbounded,
with no client following it. The guard is the worker's own lifetime timer,
on every backend.

Before it becomes a subreaper (what it starts then stays below it, and
would be taken for its command's leftovers), the worker forks the guard
into a session of its own. The guard holds the read end of a pipe whose
write end only the worker holds: the worker writes its command's deadline
there (a `time.monotonic()` value, one clock for every process) before
starting the command, or closes it without one (the command did not
start); and the pipe reads as closed the moment the worker exits, however
it exits. Then `orphaned(deadline)` runs in the guard (worker.py: the tree
stopped at the deadline, unless the run has ended). No polling while the
worker lives, and no process left once it is gone.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Optional


def start(orphaned: Callable[[float], None]) -> int:
    """Fork the guard (see above); the write end of its pipe, for the
    caller alone to hold."""
    read_fd, write_fd = os.pipe()  # not inherited by what the worker execs (PEP 446)
    first = os.fork()
    if first == 0:  # forks the guard and exits at once: the guard is reparented away
        code = 0
        try:
            os.close(write_fd)
            os.setsid()
            if os.fork() == 0:
                code = 1
                keep_only(read_fd)
                watch(read_fd, orphaned)
                code = 0
        finally:
            os._exit(code)
    os.close(read_fd)
    os.waitpid(first, 0)
    return write_fd


def arm(write_fd: int, deadline: float) -> None:
    """Tell the guard when the command must be over (monotonic seconds)."""
    os.write(write_fd, b"%r\n" % deadline)


def keep_only(read_fd: int) -> None:
    """Hold nothing of the worker's but the pipe: not its log (a process
    holding it with the worker's command line would count as one of the
    run's workers: control.workers_of), not the locks of its GPUs, not its
    folder (a file system the guard's folder were on could not be
    unmounted). The job's paths are absolute."""
    os.chdir("/")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != read_fd:
            with contextlib.suppress(OSError):  # the listing's own fd, closed already
                os.close(fd)


def read_deadline(read_fd: int) -> Optional[float]:
    """The deadline the worker wrote; None if the pipe closed first."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(read_fd, 64)
        if not chunk:
            return None
        line += chunk
    try:
        return float(line)
    except ValueError:
        return None


def watch(read_fd: int, orphaned: Callable[[float], None]) -> None:
    deadline = read_deadline(read_fd)
    if deadline is None:  # no command was started
        return
    while os.read(read_fd, 4096):  # until the worker exits, whichever way
        pass
    orphaned(deadline)
