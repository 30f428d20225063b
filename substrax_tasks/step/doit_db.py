"""doit's dependency DB as `doit_config()` sets it: doit's own sqlite3
backend, which on a full disk says so and what to do instead of ending in
a traceback (`database or disk is full`, exit status 3).

doit writes its DB once, when every task has run, and calls its teardowns
after that: a save that fails is reported here and the run goes on to its
teardowns; `SummaryReporter` then ends `doit` with exit status 1. Nothing
already in place is lost: the DB keeps what the last doit saved (sqlite
rolls the failed write back), and every step keeps its own durable record
under `.substrax`, so the next `doit` after space is freed finds the runs it
finished and runs no command whose outputs are home and verified. A verified
run is not marked acknowledged either (`_outputs_phases.acknowledge`): doit
never saved its value.

Registered with doit under the name `BACKEND` (an entry point of the
package: `doit.BACKEND`), the name `doit_config()` gives as its backend.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any

from doit.dependency import SqliteDB

BACKEND = "substrax-sqlite3"
SQLITE_FULL = 13  # sqlite's result code, named in the sqlite3 module from Python 3.11
# Whether a save of this process failed for want of space; read by the
# reporter (exit status 1) and by acknowledge (no value, no acknowledgement).
_unsaved: list[str] = []
# File systems a step already said are full: the DB's failure there adds nothing.
_told: set[str] = set()
_lock = threading.Lock()


# Whether a step's teardown as doit ended found the disk full (said by the
# step): the reporter ends doit with exit status 1 then too.
_failed_at_end: list[bool] = []


def failed_as_doit_ended() -> None:
    with _lock:
        _failed_at_end.append(True)


def ended_failed() -> bool:
    with _lock:
        return bool(_failed_at_end)


def told_full(where: str) -> None:
    with _lock:
        _told.add(where)


def save_failed() -> bool:
    with _lock:
        return bool(_unsaved)


def mount_point(path: str) -> str:
    """The mount point of the file system that holds `path` (which need
    not exist yet)."""
    found = Path(path).resolve()
    while not found.is_mount():
        found = found.parent
    return str(found)


def no_space_left(exc: BaseException, where: str) -> bool:
    """Whether `exc`, raised writing at `where`, means the disk is full.
    sqlite says SQLITE_FULL for its pages, and I/O error for a journal it
    could not write: that one is taken as full only when the disk is."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL or "disk is full" in str(exc):
        return True
    try:
        found = os.statvfs(Path(where).resolve().parent)
    except OSError:
        return False
    return found.f_bavail == 0


def disk_full_message(dep_file: str, *, started: bool) -> str:
    dep_file = str(Path(dep_file).resolve())
    where = mount_point(dep_file)
    if started:
        kept = (f"doit could not save its record of this run in {dep_file}, which stays as the last "
                "doit left it; your outputs and the steps' own records under .substrax are kept")  # fmt: skip
        then = "finishes what this one started, and runs no command whose outputs are home and verified"
    else:
        kept = f"doit could not open its DB {dep_file}; nothing was run"
        then = "runs"
    return (f"no space left on the file system mounted at {where}: {kept}. "
            f"Free space there and run `doit` again: it {then}")  # fmt: skip


def _say(message: str) -> None:
    print(f"substrax: error: {message}", file=sys.stderr, flush=True)


class SubstraxSqliteDB(SqliteDB):  # type: ignore[misc]  # doit is untyped
    """doit's sqlite3 backend that says so when the disk is full."""

    desc = "doit's sqlite3 backend; a full disk is one message and exit status 1"

    def __init__(self, name: str, codec: Any, *, module_name: str | None = None) -> None:
        try:
            super().__init__(name, codec, module_name=module_name)
        except Exception as exc:  # doit wraps sqlite's error in its DatabaseException
            if not no_space_left(exc.__context__ or exc, name):
                raise
            _say(disk_full_message(name, started=False))
            raise SystemExit(1) from None  # before any task: nothing to tear down

    def remove(self, task_id: str) -> None:
        """doit removes a failed task's values at once, not at the save."""
        try:
            super().remove(task_id)
        except (sqlite3.Error, OSError) as exc:
            self._unsaved(exc)

    def remove_all(self) -> None:
        try:
            super().remove_all()
        except (sqlite3.Error, OSError) as exc:
            self._unsaved(exc)

    def dump(self) -> None:
        try:
            if self.name in _unsaved:  # all or nothing: sqlite rolls back what this run wrote
                self._conn.close()
                return
            super().dump()
        except (sqlite3.Error, OSError) as exc:
            self._unsaved(exc)
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()

    def _unsaved(self, exc: BaseException) -> None:
        """A write that failed: for want of space, said once, and the DB
        is not saved this run; any other failure is doit's to report."""
        if not no_space_left(exc, self.name):
            raise exc
        where = mount_point(self.name)
        with _lock:
            first = self.name not in _unsaved and where not in _told
            _unsaved.append(self.name)
        if first:
            _say(disk_full_message(self.name, started=True))
