"""Folders of this user's own outside the project: ssh's control sockets and
the cached resolved configuration, made and checked safely.

On a shared machine anyone can create /tmp/substrax-<uid> before we do: as a
folder of their own (they could then read what we keep there, or plant a
control socket that ssh would talk to, or a cached configuration naming
another state_dir), or as a symlink to a folder they choose. So a folder is
used only when it is a real folder (not a link), owned by us, and writable
by no one else. `$XDG_RUNTIME_DIR` (systemd's /run/user/<uid>, private to
the user by design) is preferred when it is set and is private itself.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from substrax_tasks.errors import SubstraxError

RUNTIME_ENV = "XDG_RUNTIME_DIR"


class UnsafeFolder(SubstraxError):
    """A private folder is not ours alone: nothing in it is used."""


def _is_private(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def private_path(name: str, max_length: int | None = None) -> Path:
    """Where the private folder `name` is: `$XDG_RUNTIME_DIR/name` when that
    folder is set and private, else `<temp folder>/name-<uid>`; /tmp when
    the path must be at most `max_length` characters and would not be.
    Nothing is created."""
    runtime = os.environ.get(RUNTIME_ENV, "")
    candidates: list[Path] = []
    if Path(runtime).is_absolute():
        try:
            if _is_private(os.lstat(runtime)):
                candidates.append(Path(runtime) / name)
        except OSError:
            pass
    candidates.append(Path(tempfile.gettempdir()) / f"{name}-{os.getuid()}")
    candidates.append(Path("/tmp") / f"{name}-{os.getuid()}")  # noqa: S108 - checked below as any other
    for folder in candidates:
        if max_length is None or len(str(folder)) <= max_length:
            return folder
    return candidates[-1]


def private_dir(name: str, max_length: int | None = None) -> Path:
    """The private folder `name` (see `private_path`), made with mode 0700
    if absent. One that exists must be a folder, not a link, owned by us and
    writable by no one else, or UnsafeFolder is raised naming it and the fix.
    One of ours that others may only read or enter is closed to 0700: no
    one else could have put anything in it."""
    folder = private_path(name, max_length)
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeFolder(f"cannot make the private folder {folder}: {exc.strerror}; {_fix()}") from None
    st = os.lstat(folder)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise UnsafeFolder(
            f"{folder} is {what}, where substrax keeps a private folder; someone may have put it "
            f"there to catch what substrax writes. Remove it (rm {folder}) and run again, or {_fix()}"
        )
    if st.st_uid != uid:
        raise UnsafeFolder(
            f"{folder} belongs to uid {st.st_uid}, not to you (uid {uid}): substrax will not use a "
            f"private folder someone else made. Have its owner or an administrator remove it, or {_fix()}"
        )
    if st.st_mode & 0o022:
        raise UnsafeFolder(
            f"{folder} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): what is in it "
            f"cannot be trusted. Remove it (rm -r {folder}) and run again, or {_fix()}"
        )
    if st.st_mode & 0o077:
        folder.chmod(0o700)
    return folder


def _fix() -> str:
    return f"set {RUNTIME_ENV} or TMPDIR to a folder only you can write (mode 0700)"


def trusted_file(path: Path) -> bytes | None:
    """The bytes of `path` if it is a regular file (not a link), owned by us
    and writable by no one else; None otherwise, or when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)
