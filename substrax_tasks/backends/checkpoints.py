"""A step's checkpoints as the store keeps them (`remote_step(...,
checkpoints="ckpt/")`), shared by the backends.

One folder per step and key (RunStore.checkpoints_dir): a changed command
or input has another key, so it starts with no checkpoints, and the
snapshot of another key is never put in place.

* The local backend binds `live/` there into the sandbox: the command
  writes into the store itself, and every later attempt of that key finds
  what it left.
* A run on another machine is pulled home as snapshots: `snap-<id>/files/`
  with `snap-<id>/manifest.json`, the files as verified against the list
  taken at that pull. `latest` is a symlink to the newest whole snapshot,
  replaced by rename: a pull killed half-way leaves the previous one in
  place, and the others are removed once `latest` names the new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks._remote import checkpoints as remote_checkpoints
from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError

if TYPE_CHECKING:
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.run_store import RunStore

LATEST = "latest"
LIVE = "live"
HASH_CHUNK = 1 << 20
# How rsync says a write found the disk full (ENOSPC) or the quota spent
# (EDQUOT): `write failed on "PATH": No space left on device (28)`.
_RSYNC_DISK_FULL = re.compile(r'write failed on "[^\n]*": [^\n]*\((28|122)\)')


def checkpoints_folder(store: RunStore, handle: RunHandle) -> Path | None:
    """The folder of the run's step and key, or None for a step without checkpoints."""
    if handle.spec.checkpoints is None:
        return None
    return store.checkpoints_dir(handle.step, str(handle.state.key or handle.spec_digest))


def live_folder(store: RunStore, handle: RunHandle) -> str | None:
    """The local backend's: the folder bound writable into the sandbox."""
    folder = checkpoints_folder(store, handle)
    if folder is None:
        return None
    live = folder / LIVE
    made_in_store(live, store.checkpoints_dir(handle.step).parent, handle.step)
    # Its worker made it safe as the command ended; a worker killed before
    # then did not, and the next attempt must not find a setuid file here.
    remote_checkpoints.make_safe(str(live))
    left = sum(len(files) for _top, _dirs, files in os.walk(live))
    if left:  # said, as a resume is on ssh: the user sees the run will not start from nothing
        emit(f"{handle.step}: checkpoints of an earlier run in place ({left} file(s))")
    return str(live)


def made_in_store(folder: Path, base: Path, step: str) -> None:
    """`folder` made, with its parents. A file in its way under `base` (a
    damaged store: nothing there is a file) is moved aside, kept and said,
    and the step's checkpoints start afresh, rather than every launch
    failing on it."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        return
    except (FileExistsError, NotADirectoryError):
        pass
    for part in [*reversed(folder.parents), folder]:
        if part.is_relative_to(base) and part.exists() and not part.is_dir():
            aside = part.with_name(f"{part.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
            part.replace(aside)
            emit(f"{step}: {part} in the store was not a folder (damaged): moved aside to {aside}; "
                 "its checkpoints start afresh")  # fmt: skip
            break
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class Snapshots:
    """The verified snapshots of one step and key, pulled from another machine."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def latest(self) -> tuple[Path, dict[str, dict[str, Any]]] | None:
        """(the files of the newest whole snapshot, its manifest by path), or None."""
        snapshot = self.folder / LATEST
        try:
            manifest = json.loads((snapshot / "manifest.json").read_text())
            return snapshot.resolve() / "files", {e["path"]: e for e in manifest["entries"]}
        except (OSError, ValueError, KeyError, TypeError):  # unreadable or damaged: no whole snapshot
            return None

    def pull(self, listed: list[dict[str, Any]], download: Callable[[list[str], Path], None]) -> int:
        """A new snapshot of the files `listed` there (path, size, sha256),
        brought by `download(paths, into)` and kept only where the copy
        matches the list; a file changed during the copy keeps its previous
        snapshot's version, if any. Made `latest` once whole; the number of
        files it holds. One pull at a time (a lock): a `doit` and a
        `substrax-compute logs --follow` may both pull the same run."""
        try:
            made_in_store(self.folder, self.folder.parent.parent, self.folder.parent.name)
            with (self.folder / ".lock").open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return self._pull(listed, download)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full() from None
            raise
        except BackendError as exc:
            if _RSYNC_DISK_FULL.search(str(exc)):  # rsync's words for ENOSPC and EDQUOT
                raise self._disk_full() from None
            raise

    def _disk_full(self) -> BackendError:
        """The one line a pull that filled this disk says: the partial copy
        is gone by now, the last snapshot stays, and the run goes on."""
        mount = self.folder.resolve()
        while not mount.is_mount():
            mount = mount.parent
        return BackendError(
            f"no space left on the file system mounted at {mount} (writing {self.folder}); the last "
            "whole snapshot is kept and the run goes on. Free space there: the next pull brings them home"
        )

    def _pull(self, listed: list[dict[str, Any]], download: Callable[[list[str], Path], None]) -> int:
        name = f"snap-{secrets.token_hex(6)}"
        new = self.folder / f".{name}.partial"
        files = new / "files"
        files.mkdir(parents=True)
        try:
            if listed:
                download([e["path"] for e in listed], files)
            previous = self.latest()
            kept: list[dict[str, Any]] = []
            for entry in listed:
                path = files / entry["path"]
                if path.is_file() and not path.is_symlink() and sha256_of(path) == entry["sha256"]:
                    kept.append(entry)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                # Changed during the pull: the version of the last snapshot
                # (whole, verified then) stays until the next pull.
                old = previous[1].get(entry["path"]) if previous else None
                if previous and old:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(previous[0] / entry["path"], path)
                    kept.append(old)
            (new / "manifest.json").write_text(json.dumps({"entries": kept}))
            # The copy's modes are the host's (rsync's --chmod already drops
            # the unsafe bits) or an earlier snapshot's: one rule, applied here.
            remote_checkpoints.make_safe(str(new))
            new.rename(self.folder / name)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        link = self.folder / f".{LATEST}.{secrets.token_hex(6)}"
        link.symlink_to(name)
        link.replace(self.folder / LATEST)
        for other in self.folder.glob("snap-*"):
            if other.name != name:
                shutil.rmtree(other, ignore_errors=True)
        return len(kept)

