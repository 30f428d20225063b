"""At most N of a kind at once: N lock files in a folder, one per slot.

A slot is held by holding its file's lock (flock), so the limit holds across
every doit process of a project (the folder is under its state folder) and
across the threads of one (flock locks belong to an open file: two threads
with their own files exclude each other as two processes do).

A killed client's lock is dropped by the kernel, but the run it drove may
go on without it: each slot's `<index>.holder` names the run that took it
last, and a slot whose lock is free is still held while that run's command
runs. The run itself takes it back when a client reattaches to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from substrax_tasks.atomic import write_bytes_atomic
from substrax_tasks.console import emit
from substrax_tasks.interrupts import check_interrupted


@dataclass(frozen=True)
class Pool:
    """The limit a new run counts against (max_parallel): at most `limit`
    runs of pool `name` at once, across the project's doit processes.

    where: said while a step waits ("waits for a free slot on <where>");
    shared: a slot is a machine runs take turns on (a reused cluster), kept
    when a run ends: the slot is released then, the machine torn down later;
    prefer: the slots to try first (those holding a warm machine).
    """

    name: str
    limit: int
    where: str
    shared: bool = False
    prefer: tuple[int, ...] = ()


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


def holder_path(folder: Path, index: int) -> Path:
    return folder / f"{index}.holder"


def take_for(folder: Path, index: int, run_id: str, running: Callable[[str], bool]) -> Slot | None:
    """Slot `index` for run `run_id`, if its lock is free and the run it
    names (its last holder) is this one or has no command running; the
    slot then names `run_id`."""
    slot = try_take(folder, index)
    if slot is None:
        return None
    path = holder_path(folder, index)
    try:
        last = path.read_text().strip()
    except OSError:
        last = ""
    if last and last != run_id and running(last):
        slot.release()
        return None
    if last != run_id:
        write_bytes_atomic(path, run_id.encode())
    return slot


def take_in_pool(
    folder: Path, pool: Pool, step: str, run_id: str, running: Callable[[str], bool], *, wait: bool = True,
    only: int | None = None,
) -> Slot | None:
    """The first free slot of a backend's max_parallel pool for run `run_id`
    of `step` (one naming that run first, then the pool's preferred ones),
    waiting for one if all are held, which is said once; without `wait`,
    None then; `only`: the one slot the run may take (the machine it is
    on). Ctrl-C ends the wait, in the main thread as in doit's worker
    threads."""
    prefer = pool.prefer
    order = [i for i in prefer if 0 <= i < pool.limit] + [i for i in range(pool.limit) if i not in prefer]
    own = [i for i in order if _names(folder, i, run_id)]
    order = [only] if only is not None else own + [i for i in order if i not in own]
    said = False
    while True:
        for index in order:
            slot = take_for(folder, index, run_id, running)
            if slot is not None:
                return slot
        if not wait:
            return None
        if not said:
            emit(f"{step} waits for a free slot on {pool.where} ({pool.limit} running)")
            said = True
        check_interrupted()
        time.sleep(POLL_SECONDS)


def _names(folder: Path, index: int, run_id: str) -> bool:
    try:
        return holder_path(folder, index).read_text().strip() == run_id
    except OSError:
        return False
