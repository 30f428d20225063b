"""One driver per step: an exclusive lock held while a run is created or driven.

doit's dependency DB does not stop two `doit` processes from launching the
same step twice, so each step's chain holds `<state>/locks/<step>.lock`
(flock, released by the kernel if the holder dies) and says who holds it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from filelock import FileLock, Timeout

from substrax_tasks._atomic import write_json_atomic
from substrax_tasks.errors import SubstraxError
from substrax_tasks.store import utc_now


class StepBusy(SubstraxError):
    """Another process is driving this step."""


class StepLock:
    def __init__(self, lock_dir: Path, safe_step: str, step: str) -> None:
        lock_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.step = step
        self.holder_file = lock_dir / f"{safe_step}.holder.json"
        # thread_local=False: doit may take it in one thread and run the
        # teardown that releases it in another.
        self._lock = FileLock(str(lock_dir / f"{safe_step}.lock"), thread_local=False)

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self, wait_seconds: float = 0.0) -> None:
        if self._lock.is_locked:
            return
        try:
            self._lock.acquire(timeout=wait_seconds)
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
                "since": utc_now().isoformat(timespec="seconds"),
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
        if self._lock.is_locked:
            self._lock.release(force=True)
