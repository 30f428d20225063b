"""The stat-only walk of a step's outputs behind each step's proof
(`stat_walk`, `stamp_of`): what changed in a tree, as this side sees it,
without reading a file.

It runs only here, never on a host, so it lives in the package rather than
in `remote/manifest.py`, whose path rules (`check_outputs`) it shares.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import stat
from collections.abc import Sequence
from typing import Any

from substrax_tasks.uptodate.manifests import manifest_module

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a folder, never through a symlink


def stamp_of(items: list[Any]) -> str:
    """The digest of what `stat_walk` (or several) appended to `items`."""
    # marshal format 2 has no back-references, so equal lists give equal bytes
    return hashlib.sha256(marshal.dumps(items, 2)).hexdigest()


def stat_walk(
    base: str | os.PathLike[str], outputs: Sequence[str], items: list[Any], any_folder: bool = False
) -> int:
    """Append to `items` what ``lstat`` says about every entry under
    `outputs` (name, type and mode, size, ctime_ns, inode; the link text of
    symlinks; missing outputs and the folders above each output), and return
    the newest ctime_ns seen. Not mtime: every change to a file's content,
    size, mode or mtime also sets its ctime, to the clock, and nothing short
    of moving the clock back sets ctime back. It never reads a file and
    never raises for an odd tree (it only describes it), but refuses paths
    `check_outputs` refuses (ManifestError). With `any_folder`, a path
    declared without its trailing "/" is walked too when it is a folder
    (inputs are declared either way); outputs are walked only where they
    are declared folders.
    A caller checking several trees in one go (a step's inputs and outputs)
    hashes them once, with `stamp_of`."""
    paths = manifest_module().check_outputs(outputs)
    checked = [(rel, is_dir, is_dir or any_folder) for rel, is_dir in paths]
    return walk_checked(os.fspath(base), checked, items)


def walk_checked(  # noqa: PLR0912, PLR0915 - one hot loop, kept whole and on str paths for speed
    base: str, checked: Sequence[tuple[str, bool, bool]], items: list[Any]
) -> int:
    """`stat_walk` of paths already checked: (path, declared a folder, walk
    it when it is one). A step checks its paths once, when first asked
    (uptodate.Step.walked_paths), not at each of its walks."""
    add = items.append
    lstat = os.lstat
    newest = 0
    S_ISDIR, S_ISLNK = stat.S_ISDIR, stat.S_ISLNK
    prefix = base + "/" if base and not base.endswith("/") else base
    # the mode of each folder above an output, by path: outputs declared
    # file by file share their folders (100 files in one: 1 lstat, not 100)
    folder_modes: dict[str, int] = {}
    for rel, is_dir, walk in checked:
        add(rel)
        add(is_dir)
        at = rel.find("/")
        while at != -1:
            folder = rel[:at]
            mode = folder_modes.get(folder)
            if mode is None:
                try:
                    mode = os.lstat(prefix + folder).st_mode
                except OSError:
                    mode = -1
                folder_modes[folder] = mode
            add(mode)
            at = rel.find("/", at + 1)
        top = prefix + rel
        try:
            st = os.lstat(top)
        except OSError:
            add(None)
            continue
        mode = st.st_mode
        add((mode, st.st_size, st.st_ctime_ns, st.st_ino, st.st_dev))
        newest = max(newest, st.st_ctime_ns)
        if S_ISLNK(mode):
            add(_readlink_or_none(top))
        if not (walk and S_ISDIR(mode)):
            continue
        stack = [(top, rel)]
        while stack:
            dir_abs, dir_rel = stack.pop()
            add(dir_rel)
            try:
                fd = os.open(dir_abs, _O_DIR)
            except OSError:
                add(None)
                continue
            try:
                # Each entry's lstat is an fstatat() of its bare name in the
                # open folder (the kernel does not walk the whole path again),
                # and a name from listdir() is one object where scandir()'s
                # DirEntry was two: ~8% of a no-op proof's CPU.
                for name in os.listdir(fd):  # noqa: PTH208 - a descriptor, not a path
                    try:
                        est = lstat(name, dir_fd=fd)
                    except OSError:
                        add((name, None))  # vanished under the walk
                        continue
                    emode = est.st_mode
                    ctime = est.st_ctime_ns
                    if ctime > newest:  # noqa: PLR1730 - max() costs ~5% of a proof here
                        newest = ctime
                    add((name, emode, est.st_size, ctime, est.st_ino))
                    kind = emode & 0o170000  # by mask, not S_ISDIR() calls: runs for every file
                    if kind == 0o040000:
                        stack.append((dir_abs + "/" + name, dir_rel + "/" + name))
                    elif kind == 0o120000:
                        add(_readlink_or_none(dir_abs + "/" + name))
            except OSError:
                add(None)
            finally:
                os.close(fd)
    return newest


def _readlink_or_none(path: str) -> str | None:
    try:
        return os.readlink(path)  # noqa: PTH115 - a str in, a str out
    except OSError:
        return None
