"""The client's identity: a state folder's own random id, and what tells
that folder from a copy of it.

    client-id          the id (32 hex digits): marks the run folders and
                       clusters this client makes on machines others share
    client-id.stamp    where that id was made: the state folder's inode,
                       the id file's inode and its ctime; the other ids this
                       folder held (one removed as damaged); whether the
                       runs recorded with no id (an earlier release) are its own

A copy of the folder (`cp -a`, a CI cache restored, a clone under /tmp,
even at the same path after `rm -rf`) carries the id but not where it was
made: a copied file has a new inode, and its ctime is the copy's time
(nothing sets a ctime back; an inode freed by `rm -rf` may well be given
again, a ctime to the nanosecond is not). Such a folder takes an id of its
own, and the runs it holds stay the original's: it neither reattaches,
fetches, cancels nor tears them down, and gc counts their folders as
another client's. A `mv` of the project on one file system keeps both
inodes and the ctime: the same client, as it should. A `chown` or `chmod`
of `client-id` (and a move to another file system) reads as a copy too:
the runs then going are left to their lifetime timer (docs/handles.md).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.console import emit
from substrax_tasks.errors import HandleError

CLIENT_ID_FILE = "client-id"
STAMP_FILE = "client-id.stamp"
CLIENT_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Identity:
    """This state folder's id and the runs it owns by their recorded id."""

    id: str
    also_own: tuple[str, ...]  # ids this folder held before (one removed as damaged)
    owns_unmarked: bool  # runs recorded with no id (an earlier release) are its own

    def owns(self, recorded: str | None) -> bool:
        """A run recorded with this id (None: with none) is this client's."""
        return self.owns_unmarked if recorded is None else recorded == self.id or recorded in self.also_own


def identity(root: Path) -> Identity:
    """The identity of the state folder `root`, made on first use and made
    anew once the folder is found to be a copy. Under a lock when anything
    is written, so processes that start at once agree."""
    found = _stamped(root)
    if found is not None:
        return found
    from filelock import FileLock

    (root / "locks").mkdir(parents=True, exist_ok=True, mode=0o700)  # as the step locks' (steplock.py)
    with FileLock(root / "locks" / "client-id.lock", mode=0o600):
        found = _stamped(root)
        return found if found is not None else _take_identity(root)


def _where(root: Path) -> tuple[str, dict[str, int]] | None:
    """The id in `client-id` and where it is (from one descriptor: the two
    agree even while another process replaces it); None: no such file."""
    path = root / CLIENT_ID_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        text = f.read(200).strip()
    if not CLIENT_ID.fullmatch(text):
        raise HandleError(
            f"{path} holds no id this client made ({text[:40]!r}); remove it and a new one is made "
            "(what the old one marked on machines is then left to its lifetime timer, or to "
            "`substrax-compute teardown RUN`)"
        )
    return text, {"folder_inode": root.stat().st_ino, "inode": st.st_ino, "ctime_ns": st.st_ctime_ns}


def _read_stamp(root: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads((root / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _identity_of(stamp: dict[str, Any], client_id: str) -> Identity:
    also = stamp.get("also_own")
    return Identity(client_id, tuple(str(i) for i in also) if isinstance(also, list) else (),
                    stamp.get("owns_unmarked") is True)  # fmt: skip


def _stamped(root: Path) -> Identity | None:
    """The identity, if `client-id` is where its stamp says it was made."""
    where, stamp = _where(root), _read_stamp(root)
    if where is None or stamp is None or stamp.get("id") != where[0]:
        return None
    if any(stamp.get(name) != value for name, value in where[1].items()):
        return None
    return _identity_of(stamp, where[0])


def _take_identity(root: Path) -> Identity:
    """Under the lock: stamp the id there is, or make one (a new folder, a
    copy, an id removed as damaged)."""
    where, stamp = _where(root), _read_stamp(root)
    if where is not None and (stamp is None or stamp.get("id") != where[0]):
        # Made by an earlier release (or stamped by none yet): its own, and so are its runs.
        return _stamp(root, Identity(where[0], (), owns_unmarked=True))
    if where is not None and stamp is not None:
        made = _stamp(root, Identity(_new_id(root), (), owns_unmarked=False))
        emit(
            f"{root} is a copy of another project's state folder (its client-id was made elsewhere): "
            f"it takes an id of its own; the runs recorded in it stay the original's (not reattached, "
            "fetched, cancelled or removed from here)",
            err=True,
        )
        return made
    if stamp is not None and isinstance(stamp.get("id"), str):  # its id removed (as damaged): the same folder
        kept = _identity_of(stamp, stamp["id"])
        return _stamp(root, Identity(_new_id(root), (*kept.also_own, kept.id), kept.owns_unmarked))
    return _stamp(root, Identity(_new_id(root), (), owns_unmarked=True))


def _new_id(root: Path) -> str:
    """A new random id (128 bits, hex) in `client-id`, replacing any there."""
    path = root / CLIENT_ID_FILE
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{path.name}.", suffix=".tmp")
    made = secrets.token_hex(16)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(made + "\n")
            f.flush()
            os.fsync(f.fileno())
        Path(tmp).replace(path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return made


def _stamp(root: Path, made: Identity) -> Identity:
    where = _where(root)
    if where is None or where[0] != made.id:
        raise HandleError(f"{root / CLIENT_ID_FILE} changed while its id was being made; run again")
    write_json_atomic(root / STAMP_FILE, {
        "id": made.id, **where[1], "also_own": list(made.also_own), "owns_unmarked": made.owns_unmarked,
    })  # fmt: skip
    return made
