"""At most N of a kind at once: N lock files in a folder, one per slot.

A slot is held by holding its file's lock (flock), so the limit holds across
every doit process of a project (the folder is under its state folder) and
across the threads of one (flock locks belong to an open file: two threads
with their own files exclude each other as two processes do). A killed
holder frees its slot: the kernel drops its lock.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks._output import emit
from substrax_tasks._signals import check_interrupted

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Pool

POLL_SECONDS = 0.2


class Slot:
    """A held slot: `index` in 0..limit-1, until release()."""

    def __init__(self, index: int, lock: Any) -> None:
        self.index = index
        self._lock = lock

    def release(self) -> None:
        self._lock.release(force=True)


def try_take(folder: Path, index: int) -> Slot | None:
    """Slot `index` if it is free now, else None."""
    from filelock import FileLock, Timeout

    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    # thread_local=False: the thread that releases may not be the one that took it
    lock = FileLock(str(folder / f"{index}.lock"), thread_local=False, is_singleton=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return None
    return Slot(index, lock)


def take_in_pool(folder: Path, pool: Pool, step: str) -> Slot:
    """The first free slot of a backend's max_parallel pool for `step` (the
    pool's preferred ones first), waiting for one if all are held, which is
    said once. Ctrl-C ends the wait, in the main thread as in doit's worker
    threads."""
    prefer = pool.prefer
    order = [i for i in prefer if 0 <= i < pool.limit] + [i for i in range(pool.limit) if i not in prefer]
    said = False
    while True:
        for index in order:
            slot = try_take(folder, index)
            if slot is not None:
                return slot
        if not said:
            emit(f"{step} waits for a free slot on {pool.where} ({pool.limit} running)")
            said = True
        check_interrupted()
        time.sleep(POLL_SECONDS)
