#!/usr/bin/env python3
"""A step's checkpoints folder on the machine that runs it.

Stdlib only, Python 3.8+. Over ssh it runs beside worker.py:

    python3 checkpoints.py list ROOT

prints one JSON line, `{"root": ROOT, "entries": [{"path", "size",
"sha256"}, ...]}`: the files of the folder the command has finished, each
hashed now. The client copies those files home and keeps the copy only
where it matches this list (a file replaced during the copy is left for
the next pull), so a snapshot never holds half a file of a command that
writes by rename (`torch.save` to a temporary name, then `os.replace`).
A file whose name marks it temporary (TEMPORARY) is never listed, nor is a
file that changes while it is hashed, nor a symlink or anything but a
regular file.

With the bucket transport the snapshots go from here to the bucket the
cluster mounts, not through the client:

    python3 checkpoints.py push ROOT DEST [LOCK]
    python3 checkpoints.py restore DEST KEPT

`push` copies the finished files into `DEST/snap-<id>/files/`, each hashed
as it is copied and kept only if it is the file listed (one replaced under
the copy keeps the previous snapshot's version), writes the snapshot's
`manifest.json`, and only then replaces `DEST/latest.json`, which names the
newest whole snapshot: a push killed half-way leaves the previous one
named. `restore` copies the snapshot `latest.json` names into KEPT, each
file checked against its manifest, before the command starts. Both print
one JSON line (`{"files": N}`).

Without a sandbox the command writes its checkpoints in place, in the
project: the worker copies the kept folder there before the command
starts (`put_in_place`) and back once it has ended (`keep_from_place`).

Wherever checkpoint files land (the kept folder as the command ends, a
snapshot, a restore) they keep no setuid, setgid or sticky bit and are not
world-writable (`make_safe`), as the outputs promoted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple

PACKAGED = bool(__package__)
if PACKAGED:
    from . import manifest
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import manifest

# Names a file being written goes by: dot files (rsync's, mkstemp's and
# most editors' temporaries) and these endings, or ".tmp." inside a name.
TEMPORARY_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", "~", ".swp")


# What no checkpoint file or folder keeps: the promotion's rule for outputs
# (run/promote.py UNSAFE_BITS; a unit test holds the two together). A
# setuid file a command made in its checkpoints (as root in a sandbox, or
# as a host's login) would stay in the client's state folder and run as
# its owner, root on CI; a world-writable one anyone there could change.
UNSAFE_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWOTH


def make_safe(root: str) -> None:
    """`root` and every file and folder under it without UNSAFE_BITS
    (symlinks are left: their mode means nothing, and chmod would follow
    them). Called where no command of the step runs any more."""
    for top, dirs, files in os.walk(root):  # never follows a link
        for path in [top] + [os.path.join(top, name) for name in dirs + files]:
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue
            if mode & UNSAFE_BITS and not stat.S_ISLNK(mode):
                os.chmod(path, stat.S_IMODE(mode) & ~UNSAFE_BITS)


def is_temporary(name: str) -> bool:
    return name.startswith(".") or name.endswith(TEMPORARY_SUFFIXES) or ".tmp." in name


def over_bound(root: str, max_bytes: Optional[int]) -> Optional[Dict[str, Any]]:
    """When the finished files under `root` take more than `max_bytes`:
    their total and the largest (a stat each, nothing read: a snapshot over
    the bound costs no hashing); else None."""
    if max_bytes is None:
        return None
    total, largest = 0, (0, "")
    for rel, st in _finished(root):
        total += st.st_size
        largest = max(largest, (st.st_size, rel))
    if total <= max_bytes:
        return None
    return {"bytes": total, "largest": largest[1], "size": largest[0]}


def _finished(root: str) -> Iterator[Tuple[str, os.stat_result]]:
    """(path, stat) of each finished file under `root`, sorted by path."""
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not is_temporary(d))  # os.walk never follows links
        for name in sorted(files):
            if is_temporary(name):
                continue
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:  # gone: the next pull
                continue
            if stat.S_ISREG(st.st_mode):
                yield os.path.relpath(path, root).replace(os.sep, "/"), st


def finished_files(root: str) -> List[Dict[str, Any]]:
    """The files under `root` the command has finished, sorted by path."""
    entries: List[Dict[str, Any]] = []
    buf = memoryview(bytearray(manifest.BUFFER_SIZE))
    for rel, st in _finished(root):
        try:
            digest = manifest.hash_file(os.path.join(root, rel), st, buf)
        except (OSError, manifest.ManifestError):  # gone, or replaced while read: the next pull
            continue
        entries.append({"path": rel, "size": st.st_size, "sha256": digest})
    return entries


def _copy_tree(source: str, dest: str) -> None:
    """`dest` made a copy of `source` (or empty), replaced by rename once whole."""
    parent = os.path.dirname(dest.rstrip("/")) or "."
    os.makedirs(parent, exist_ok=True)
    temp = os.path.join(parent, ".%s.copy-%d" % (os.path.basename(dest.rstrip("/")), os.getpid()))
    shutil.rmtree(temp, ignore_errors=True)
    if os.path.isdir(source):
        shutil.copytree(source, temp, symlinks=True, copy_function=_copy_said)
    else:
        os.makedirs(temp)
    old = temp + ".old"
    if os.path.lexists(dest):
        os.rename(dest, old)
    os.rename(temp, dest)
    shutil.rmtree(old, ignore_errors=True)


def put_in_place(kept: str, project: str, rel: str) -> str:
    """Without a sandbox: the kept checkpoints copied to their project path
    before the command starts; that path, where the command writes them."""
    place = os.path.join(project, rel.rstrip("/"))
    _copy_tree(kept, place)
    return place


def keep_from_place(place: str, kept: str) -> None:
    """Without a sandbox: what the command left in `place`, kept once it ended."""
    if os.path.isdir(place):
        _copy_tree(place, kept)


LATEST_FILE = "latest.json"  # in DEST: {"snapshot": NAME}, replaced last


def _copy_said(source: str, dest: str) -> object:
    """shutil.copy2, with a progress line when one is due (a file at a time)."""
    manifest.PROGRESS.tick()
    return shutil.copy2(source, dest)


def _copy_hashed(source: str, dest: str, buf: memoryview) -> str:
    """Copy `source` to `dest` (a temporary name, renamed once whole); the
    sha256 of what was copied."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    temp = "%s.%s.partial" % (dest, uuid.uuid4().hex[:8])
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(temp, "wb") as out:
        for n in iter(lambda: src.readinto(buf), 0):
            digest.update(buf[:n])
            out.write(buf[:n])
            manifest.PROGRESS.tick()
    os.replace(temp, dest)
    return digest.hexdigest()


def _latest(dest: str) -> Optional[Tuple[str, Dict[str, Dict[str, Any]]]]:
    """(the folder of the snapshot latest.json names, its manifest by path), or None."""
    try:
        with open(os.path.join(dest, LATEST_FILE)) as f:
            name = json.load(f)["snapshot"]
        folder = os.path.join(dest, os.path.basename(str(name)))
        with open(os.path.join(folder, "manifest.json")) as f:
            entries = json.load(f)["entries"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return folder, {e["path"]: e for e in entries}


def push(root: str, dest: str, max_bytes: Optional[int] = None) -> Dict[str, Any]:
    """A new snapshot of `root`'s finished files in `dest`, named latest.json
    once whole; none (its size and largest file said) when they take more
    than `max_bytes`: the last snapshot stays."""
    over = over_bound(root, max_bytes)
    if over is not None:
        return {"over": over}
    listed = finished_files(root) if os.path.isdir(root) else []
    previous = _latest(dest)
    name = "snap-%d-%s" % (int(time.time()), uuid.uuid4().hex[:8])
    folder = os.path.join(dest, name)
    buf = memoryview(bytearray(manifest.BUFFER_SIZE))
    kept: List[Dict[str, Any]] = []
    for entry in listed:
        target = os.path.join(folder, "files", entry["path"])
        try:
            same = _copy_hashed(os.path.join(root, entry["path"]), target, buf) == entry["sha256"]
        except OSError:
            same = False
        if same:
            kept.append(entry)
            continue
        # Replaced under the copy: the version of the last snapshot (whole,
        # checked then) stays until the next push.
        if os.path.lexists(target):
            os.unlink(target)
        old = previous[1].get(entry["path"]) if previous else None
        if previous and old:
            if _copy_hashed(os.path.join(previous[0], "files", entry["path"]), target, buf) == old["sha256"]:
                kept.append(old)
            else:
                os.unlink(target)
    os.makedirs(folder, exist_ok=True)
    _write_json(os.path.join(folder, "manifest.json"), {"entries": kept})
    make_safe(folder)
    _write_json(os.path.join(dest, LATEST_FILE), {"snapshot": name})  # last: the snapshot is whole
    for other in os.listdir(dest):
        if other.startswith("snap-") and other != name:
            shutil.rmtree(os.path.join(dest, other), ignore_errors=True)
    return {"files": len(kept), "bytes": sum(int(e["size"]) for e in kept), "snapshot": name}


def restore(dest: str, kept: str) -> Dict[str, Any]:
    """The latest snapshot in `dest` copied into `kept`, every file as its
    manifest says; ValueError naming the first that is not."""
    os.makedirs(kept, exist_ok=True)
    latest = _latest(dest)
    if latest is None:
        return {"files": 0}
    folder, entries = latest
    buf = memoryview(bytearray(manifest.BUFFER_SIZE))
    for path, entry in sorted(entries.items()):
        parts = path.split("/")
        if path.startswith("/") or ".." in parts:
            raise ValueError("the snapshot %s names the file %r outside its folder" % (folder, path))
        copied = _copy_hashed(os.path.join(folder, "files", path), os.path.join(kept, path), buf)
        if copied != entry["sha256"]:
            raise ValueError("%s in the snapshot %s does not match its manifest" % (path, folder))
    make_safe(kept)
    return {"files": len(entries), "snapshot": os.path.basename(folder)}


def _write_json(path: str, data: Any) -> None:
    temp = "%s.%s.partial" % (path, uuid.uuid4().hex[:8])
    with open(temp, "w") as f:
        json.dump(data, f)
    os.replace(temp, path)


USAGE = (
    "usage: checkpoints.py list ROOT [MAX_BYTES] | push ROOT DEST [LOCK [MAX_BYTES]] | restore DEST KEPT\n"
)


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    manifest.PROGRESS.start()  # each operation may hash or copy a big tree
    if len(args) in (2, 3) and args[0] == "list":
        root = args[1]
        over = over_bound(root, int(args[2]) if len(args) == 3 else None)
        if over is not None:  # not listed: the client refuses it from its size
            sys.stdout.write(json.dumps({"root": root, "over": over}) + "\n")
            return 0
        entries = finished_files(root) if os.path.isdir(root) else []
        sys.stdout.write(json.dumps({"root": root, "entries": entries}) + "\n")
        return 0
    if len(args) in (3, 4, 5) and args[0] == "push":
        os.makedirs(args[2], exist_ok=True)
        # One push at a time per run (a doit and a `logs --follow` may both
        # push): on the machine's own disk, as a mounted bucket may not lock.
        with open(args[3] if len(args) >= 4 else os.devnull, "a") as lock:
            if len(args) >= 4:
                fcntl.flock(lock, fcntl.LOCK_EX)
            answer = push(args[1], args[2], int(args[4]) if len(args) == 5 else None)
        sys.stdout.write(json.dumps(answer) + "\n")
        return 0
    if len(args) == 3 and args[0] == "restore":
        try:
            answer = restore(args[1], args[2])
        except (OSError, ValueError) as exc:
            sys.stderr.write("checkpoints.py: %s\n" % exc)
            return 1
        sys.stdout.write(json.dumps(answer) + "\n")
        return 0
    sys.stderr.write(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main())
