"""Hash a fetch's files while the copy is still running.

rsync names each file it has received (its `--out-format` line), just before
it renames the file into place. A thread hashes each named file once it
stands at its final path, so that verification, after the copy, finds the
hashes ready and only walks the tree: the copy's idle CPU does the hashing.

The hashes are hash-cache entries with the file's mode (relative path ->
[size, mtime_ns, inode, sha256, mode]), which verification takes for a file
the folder's listing still shows at the same inode (`build_manifest`'s
`staged`): rsync writes each file under a temporary name and renames it into
place, so a file at its final path is complete and never written again, and
nothing else writes into staging. Nothing here decides what is verified: a
file not yet in place when its turn comes is tried again after the next
ones, and one that never is, or that changed while it was read, is simply
left out (verification then reads it itself).
"""

from __future__ import annotations

import hashlib
import os
import queue
import stat
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

BUFFER_SIZE = 1 << 20
SMALL_FILE = 1 << 16  # read in one call, without the reusable buffer
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class StagedHasher:
    """A thread hashing the files named to `add`, under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root = os.fspath(root) + os.sep
        self.entries: dict[str, list[Any]] = {}
        self._names: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._deferred: list[str] = []
        self._aborted = False
        self._view = memoryview(bytearray(BUFFER_SIZE))
        self._thread = threading.Thread(target=self._run, name="staged-hasher", daemon=True)

    def __enter__(self) -> StagedHasher:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._aborted = kind is not None  # the copy failed: the rest is not worth hashing
        self._names.put(None)
        self._thread.join()

    def add(self, rel: str) -> None:
        """A file the copy has finished (or is about to rename into place)."""
        self._names.put(rel)

    def _run(self) -> None:
        while (rel := self._names.get()) is not None:
            if self._aborted:
                continue
            # A later name means the earlier files have been renamed into place.
            if self._deferred:
                waiting, self._deferred = self._deferred, []
                for earlier in waiting:
                    self._hash(earlier, last_try=False)
            self._hash(rel, last_try=False)
        for rel in [] if self._aborted else self._deferred:
            self._hash(rel, last_try=True)
        self._deferred = []

    def _hash(self, rel: str, *, last_try: bool) -> None:
        try:
            fd = os.open(self._root + rel, _O_READ)  # a str path: pathlib costs more than the read
        except FileNotFoundError:
            if not last_try:
                self._deferred.append(rel)
            return
        except OSError:
            return  # a symlink (O_NOFOLLOW) or unreadable: verification says what it is
        try:
            entry = self._digest(fd)
        except OSError:
            entry = None
        finally:
            os.close(fd)
        if entry is not None:
            self.entries[rel] = entry

    def _digest(self, fd: int) -> list[Any] | None:
        """[size, mtime_ns, inode, sha256, mode] of the open file, or None if it is
        not a regular file or its size was not what was read. A file at its
        final path is complete (rsync renames it there) and nothing else
        writes into staging; should anything, it would change the mtime
        (set by rsync to the remote file's) or the inode, and verification
        would read the file itself."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        size = st.st_size
        if size < SMALL_FILE:
            # One read, one more byte than expected: getting exactly `size`
            # bytes proves the end was reached, without a second call.
            data = os.read(fd, size + 1)
            total = len(data)
            digest = hashlib.sha256(data)
        else:
            digest = hashlib.sha256()
            view = self._view
            total = 0
            while n := os.readv(fd, [view]):
                digest.update(view[:n])
                total += n
        if total != size:
            return None  # changed while read: left to verification
        return [size, st.st_mtime_ns, st.st_ino, digest.hexdigest(), st.st_mode & 0o7777]
