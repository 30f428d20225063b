"""One driver per step: an exclusive lock held while a run is created or driven.

doit's dependency DB does not stop two `doit` processes from launching the
same step twice, so each step's chain holds its lock (store.step_lock)
(flock, released by the kernel if the holder dies) and says who holds it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.errors import SubstraxError


class StepBusy(SubstraxError):
    """Another process is driving this step."""


class StepLock:
    def __init__(self, path: Path, step: str) -> None:
        self.step = step
        self.path = path  # store.step_lock(step)
        self.holder_file = path.with_suffix(".holder.json")
        self._lock: Any = None  # the FileLock while held

    def acquire(self) -> None:
        """Take the lock now, or StepBusy naming who holds it."""
        from filelock import FileLock, Timeout

        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # thread_local=False: doit may take it in one thread and run the
        # teardown that releases it in another.
        lock = FileLock(str(self.path), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise StepBusy(
                f"step {self.step!r} is being run by another process ({self.describe_holder()}); "
                "wait for it to finish, or stop it (Ctrl-C, or `substrax-compute cancel RUN`)"
            ) from None
        self._lock = lock
        write_json_atomic(
            self.holder_file,
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "argv": sys.argv,
            },
        )

    def describe_holder(self) -> str:
        try:
            holder = json.loads(self.holder_file.read_text())
        except (OSError, ValueError):
            return "holder unknown"
        command = " ".join(str(a) for a in holder.get("argv", []))[:80]
        return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}: {command}"

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release(force=True)
            self._lock = None
