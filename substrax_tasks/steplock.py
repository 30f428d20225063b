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

from substrax_tasks._atomic import write_json_atomic
from substrax_tasks.errors import SubstraxError


class StepBusy(SubstraxError):
    """Another process is driving this step."""


class StepLock:
    def __init__(self, path: Path, step: str) -> None:
        self.step = step
        self._path = path  # store.step_lock(step)
        self.holder_file = path.with_suffix(".holder.json")
        self._lock: Any = None  # made on first use: a no-op doit never locks

    def _file_lock(self) -> Any:
        if self._lock is None:
            from filelock import FileLock

            # thread_local=False: doit may take it in one thread and run the
            # teardown that releases it in another.
            self._path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock = FileLock(str(self._path), thread_local=False)
        return self._lock

    @property
    def held(self) -> bool:
        return self._lock is not None and bool(self._lock.is_locked)

    def acquire(self, wait_seconds: float = 0.0) -> None:
        from filelock import Timeout

        lock = self._file_lock()
        if lock.is_locked:
            return
        try:
            lock.acquire(timeout=wait_seconds)
        except Timeout:
            raise StepBusy(
                f"step {self.step!r} is being run by another process ({self.describe_holder()}); "
                "wait for it to finish, or stop it (Ctrl-C, or `substrax-compute cancel RUN`)"
            ) from None
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
        if self.held:
            self._lock.release(force=True)
