#!/usr/bin/env python3
"""The manifest of a step's outputs: every file, folder and symlink, whole.

Standard library only, Python 3.8+: it runs where the step ran (the worker
takes the manifest as the command ends, `python3 manifest.py BASE OUTPUT...`
prints it as JSON where a run left none) and is loaded into the client,
which verifies its copies with it: one implementation for both sides.
docs/manifests.md describes the format (``digest`` is the sha256 of the
canonical JSON of ``entries`` alone, so equal trees give equal digests
whatever cache was used) and what is refused (``ManifestError``).

Symlinks are recorded as links and never followed; one whose target leads
outside its output is refused, resolved component by component through the
tree's other links (``a -> .`` then ``b -> a/../x`` escapes though ``b``
looks harmless); loops are refused.

The optional ``cache`` maps a relative path to ``[size, mtime_ns, ctime_ns,
inode, device, sha256]``: a file whose lstat gives those five values is not
read. ctime is in the key because nothing short of moving the clock back
sets it back (``os.utime`` moves it). A file whose ctime is younger than
``RACY_SECONDS`` is hashed but not cached: a second write in the same tick
would leave every value unchanged (git's "racily clean" problem). The cache
is changed only by item assignment and ``del`` (substrax_tasks/
manifest_cache.py tracks changes that way).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

VERSION = 1
BUFFER_SIZE = 1 << 20
# files changed more recently than this are hashed but not cached (see above)
RACY_SECONDS = float(os.environ.get("SUBSTRAX_RACY_SECONDS", "2"))
MAX_LINK_HOPS = 40  # like the kernel's ELOOP limit
_LOOP = "too many levels of symbolic links"
_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK

Entry = Dict[str, Any]
Cache = Dict[str, List[Any]]


class ManifestError(Exception):
    """The tree cannot be described safely (symlink escape, wrong kind of
    output, a file that changed while it was read, a bad output path)."""


def hash_file(path: str, st: os.stat_result, buf: memoryview) -> str:
    """The sha256 of the regular file `path`, which `st` (its lstat)
    describes. Opened without following links; refused if it is no longer
    the file `st` describes or if its size changes while read."""
    try:
        fd = os.open(path, _O_READ)
    except OSError as exc:
        raise ManifestError("cannot read %s: %s" % (path, exc.strerror or exc)) from exc
    with open(fd, "rb", buffering=0, closefd=True) as f:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode) or (fst.st_ino, fst.st_dev) != (st.st_ino, st.st_dev):
            raise ManifestError("%s was replaced while the manifest was taken" % path)
        h = hashlib.sha256()
        total = 0
        for n in iter(lambda: f.readinto(buf), 0):
            h.update(buf[:n])
            total += n
    if total != st.st_size:
        raise ManifestError(
            "%s changed while it was read (%d bytes read, %d expected)" % (path, total, st.st_size))
    return h.hexdigest()


def _resolve(base: str, dir_parts: List[str], target: str, budget: List[int]
             ) -> Tuple[List[str], Optional[str]]:
    """Where a link in the folder `dir_parts` (components relative to
    `base`) with text `target` leads, as ``(parts, None)``, or ``([], why)``
    if that cannot be told without leaving `base`.

    Resolved like the kernel would, one component at a time, but reading
    link text only (never following a link to read what it points at): a
    component that is itself a link is replaced by where it leads, so a
    ``..`` after it climbs from there. `budget` ([hops left]) bounds the
    links taken, like the kernel's ELOOP."""
    if target.startswith("/"):
        return [], "its target is absolute"
    parts = list(dir_parts)
    for name in target.split("/"):
        if name in ("", "."):
            continue
        if name == "..":
            if not parts:
                return [], "its target climbs out of the project"
            parts.pop()
            continue
        parts.append(name)
        try:
            st = os.lstat(os.path.join(base, *parts))
        except OSError:
            continue  # does not exist (yet): the rest is read lexically
        if stat.S_ISLNK(st.st_mode):
            budget[0] -= 1
            if budget[0] < 0:
                return [], _LOOP
            inner = os.readlink(os.path.join(base, *parts))
            resolved, why = _resolve(base, parts[:-1], inner, budget)
            if why is not None:
                return [], why if why == _LOOP else "it goes through %s -> %s, and %s" % (
                    "/".join(parts), inner, why)
            parts = resolved
    return parts, None


def kind_of(mode: int) -> str:
    """What a file mode is, in words."""
    for test, word in ((stat.S_ISDIR, "folder"), (stat.S_ISREG, "file"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "device"),
                       (stat.S_ISBLK, "device")):
        if test(mode):
            return word
    return "special file"


def check_outputs(outputs: Sequence[str]) -> List[Tuple[str, bool]]:
    """[(relative path without trailing slash, is folder output)], refusing
    absolute paths, empty, "." and ".." components, and overlaps."""
    if isinstance(outputs, str):
        raise ManifestError("outputs must be a list of paths, not the string %r" % outputs)
    checked = []
    for out in outputs:
        if not isinstance(out, str) or not out:
            raise ManifestError("bad output path %r: expected a non-empty relative path" % (out,))
        rel = out[:-1] if out.endswith("/") else out
        if out.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            raise ManifestError(
                "bad output path %r: it must be relative to the project, without '.', '..' or '//'" % out)
        checked.append((rel, out.endswith("/")))
    # sorted by components, a path comes right before those under it
    ordered = sorted((rel.split("/"), rel + "/" * is_dir) for rel, is_dir in checked)
    for (a_parts, a), (b_parts, b) in zip(ordered, ordered[1:]):  # noqa: B905 (3.8 has no strict=)
        if b_parts[: len(a_parts)] == a_parts:
            raise ManifestError("outputs %r and %r overlap: declare each path once" % (a, b))
    return checked


def _lstat_output(base: str, rel: str) -> Optional[os.stat_result]:
    """The output's lstat; None if it or a folder above it is missing. A
    link or a file on the way is refused (the output would not be where it
    is declared)."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        sub = "/".join(parts[:i])
        try:
            st = os.lstat(os.path.join(base, sub))
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise ManifestError("output %s lies under %s, a symlink: refused, never followed" % (rel, sub))
        if not stat.S_ISDIR(st.st_mode):
            raise ManifestError("output %s lies under %s, which is a %s" % (rel, sub, kind_of(st.st_mode)))
    try:
        return os.lstat(os.path.join(base, rel))
    except (FileNotFoundError, NotADirectoryError):
        return None


def build_manifest(base: str | os.PathLike[str], outputs: Sequence[str], cache: Optional[Cache] = None
                   ) -> Dict[str, Any]:
    """The manifest of `outputs` (project-relative POSIX paths, a trailing
    "/" marking a folder) under the folder `base`. Missing outputs are listed
    in "missing"; anything that cannot be described safely raises
    ManifestError, and so does a tree that cannot be read or changes under
    the walk. `cache` (see above) is read and updated in place."""
    base = os.fspath(base)
    checked = check_outputs(outputs)
    try:
        entries, missing = _walk(base, checked, cache)
    except OSError as exc:
        raise ManifestError("cannot read %s: %s (did it change while the manifest was taken?)"
                            % (base if exc.filename is None else exc.filename, exc.strerror or exc)) from exc
    entries.sort(key=lambda entry: str(entry["path"]))
    return {"version": VERSION, "entries": entries, "missing": missing, "digest": entries_digest(entries)}


def _walk(base: str, checked: List[Tuple[str, bool]], cache: Optional[Cache]
          ) -> Tuple[List[Entry], List[str]]:
    entries: List[Entry] = []
    missing: List[str] = []
    buf = memoryview(bytearray(BUFFER_SIZE))  # one read buffer for every file of the manifest
    racy_ns = time.time_ns() - int(RACY_SECONDS * 1e9)
    seen = set()

    def add(path: str, rel: str, st: os.stat_result, out_parts: List[str]) -> bool:
        """Describe one entry under an output; True for a folder to walk."""
        mode = st.st_mode
        if stat.S_ISREG(mode):
            key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
            hit = None if cache is None else cache.get(rel)
            if isinstance(hit, list) and len(hit) == 6 and hit[:5] == key:
                digest = hit[5]
                seen.add(rel)
            else:
                digest = hash_file(path, st, buf)
                if cache is not None and st.st_ctime_ns < racy_ns:
                    cache[rel] = key + [digest]
                    seen.add(rel)
                elif cache is not None:
                    cache.pop(rel, None)  # the racy rule: a file changed inside the window is not remembered
            entries.append({"path": rel, "type": "file", "size": st.st_size, "mode": mode & 0o7777,
                            "sha256": digest, "target": None})
            return False
        if stat.S_ISDIR(mode):
            entries.append({"path": rel, "type": "dir", "size": 0, "mode": mode & 0o7777, "sha256": None,
                            "target": None})
            return True
        if not stat.S_ISLNK(mode):
            raise ManifestError("%s is a %s: outputs may hold only files, folders and symlinks"
                                % (rel, kind_of(mode)))
        target = os.readlink(path)
        resolved, why = _resolve(base, rel.split("/")[:-1], target, [MAX_LINK_HOPS])
        if why is None and resolved[: len(out_parts)] != out_parts:
            why = "it leads to %s" % ("/".join(resolved) or ".")
        if why is not None:
            raise ManifestError("symlink %s -> %s %s (%s): refused, never followed" % (
                rel, target, "is a loop" if why == _LOOP else "points outside its output", why))
        entries.append({"path": rel, "type": "symlink", "size": len(os.fsencode(target)), "mode": 0o777,
                        "sha256": None, "target": target})
        return False

    for rel, is_dir in checked:
        top = os.path.join(base, rel)
        st = _lstat_output(base, rel)
        if st is None:
            missing.append(rel + "/" if is_dir else rel)
            continue
        if is_dir and not stat.S_ISDIR(st.st_mode):
            raise ManifestError("output %s/ is declared as a folder but is a %s%s" % (
                rel, kind_of(st.st_mode), ": refused, never followed" if stat.S_ISLNK(st.st_mode) else ""))
        if not is_dir and stat.S_ISDIR(st.st_mode):
            raise ManifestError(
                "output %s is declared as a file but is a folder: declare it as %s/" % (rel, rel))
        if not is_dir and stat.S_ISLNK(st.st_mode):
            raise ManifestError("output %s is a symlink -> %s, which points outside the output: refused, "
                                "never followed" % (rel, os.readlink(top)))
        if not is_dir and not stat.S_ISREG(st.st_mode):
            raise ManifestError("output %s is a %s, not a file" % (rel, kind_of(st.st_mode)))
        out_parts = rel.split("/")
        stack = [(top, rel)] if add(top, rel, st, out_parts) else []
        while stack:
            folder, folder_rel = stack.pop()
            try:
                listing = os.scandir(folder)
            except OSError as exc:
                raise ManifestError("cannot list %s: %s" % (folder_rel, exc.strerror or exc)) from exc
            with listing:
                for de in listing:
                    erel = folder_rel + "/" + de.name
                    if add(de.path, erel, de.stat(follow_symlinks=False), out_parts):
                        stack.append((de.path, erel))
    if cache is not None and len(cache) != len(seen):  # forget files under these outputs no longer there
        prefixes = tuple(rel + "/" for rel, is_dir in checked if is_dir)
        singles = set(rel for rel, is_dir in checked if not is_dir)
        for k in [k for k in cache if k not in seen and (k in singles or k.startswith(prefixes))]:
            del cache[k]
    return entries, missing


DIGEST_CHUNK = 250  # entries encoded at a time (json builds 1 KB of fragments for each)


def entries_digest(entries: List[Entry]) -> str:
    """sha256 of the canonical JSON of a manifest's entries, fed to the hash
    a chunk of entries at a time: the same bytes as the whole list encoded
    at once (a list's items are joined by ","), without holding them (6 MiB
    for 20,000 files, in text and bytes)."""
    digest = hashlib.sha256(b"[")
    for at in range(0, len(entries), DIGEST_CHUNK):
        chunk = canonical_json(entries[at:at + DIGEST_CHUNK])[1:-1]  # without its [ ]
        digest.update(("," + chunk if at else chunk).encode())
    digest.update(b"]")
    return digest.hexdigest()


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def main(argv: Optional[List[str]] = None) -> int:
    # here, not at the top: every no-op `doit` loads this module for its
    # path rules, and argparse alone was ~1 ms of that
    import argparse

    parser = argparse.ArgumentParser(prog="manifest.py", description="Print the outputs' manifest as JSON.")
    parser.add_argument("base", metavar="BASE", help="the folder the outputs are relative to")
    parser.add_argument("outputs", metavar="OUTPUT", nargs="+", help='a path ("/" at the end: a folder)')
    args = parser.parse_args(argv)
    if not os.path.isdir(args.base):
        sys.stderr.write("manifest.py: %s is not a folder\n" % args.base)
        return 1
    try:
        manifest = build_manifest(args.base, args.outputs)
    except ManifestError as exc:
        sys.stderr.write("manifest.py: %s\n" % exc)
        return 1
    sys.stdout.write(canonical_json(manifest) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
