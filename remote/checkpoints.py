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

Without a sandbox the command writes its checkpoints in place, in the
project: the worker copies the kept folder there before the command
starts (`put_in_place`) and back once it has ended (`keep_from_place`).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from typing import Any, Dict, List, Optional

PACKAGED = bool(__package__)
if PACKAGED:
    from . import manifest
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import manifest

# Names a file being written goes by: dot files (rsync's, mkstemp's and
# most editors' temporaries) and these endings, or ".tmp." inside a name.
TEMPORARY_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", "~", ".swp")


def is_temporary(name: str) -> bool:
    return name.startswith(".") or name.endswith(TEMPORARY_SUFFIXES) or ".tmp." in name


def finished_files(root: str) -> List[Dict[str, Any]]:
    """The files under `root` the command has finished, sorted by path."""
    entries: List[Dict[str, Any]] = []
    buf = memoryview(bytearray(manifest.BUFFER_SIZE))
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not is_temporary(d))  # os.walk never follows links
        for name in sorted(files):
            if is_temporary(name):
                continue
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    continue
                digest = manifest.hash_file(path, st, buf)
            except (OSError, manifest.ManifestError):  # gone, or replaced while read: the next pull
                continue
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            entries.append({"path": rel, "size": st.st_size, "sha256": digest})
    return entries


def _copy_tree(source: str, dest: str) -> None:
    """`dest` made a copy of `source` (or empty), replaced by rename once whole."""
    parent = os.path.dirname(dest.rstrip("/")) or "."
    os.makedirs(parent, exist_ok=True)
    temp = os.path.join(parent, ".%s.copy-%d" % (os.path.basename(dest.rstrip("/")), os.getpid()))
    shutil.rmtree(temp, ignore_errors=True)
    if os.path.isdir(source):
        shutil.copytree(source, temp, symlinks=True)
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


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "list":
        sys.stderr.write("usage: checkpoints.py list ROOT\n")
        return 2
    root = args[1]
    entries = finished_files(root) if os.path.isdir(root) else []
    sys.stdout.write(json.dumps({"root": root, "entries": entries}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
