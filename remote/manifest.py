#!/usr/bin/env python3
"""The manifest of a step's outputs: every file, folder and symlink, whole.

Copied to the machine that runs the step and imported by substrax_tasks here
(one implementation for both sides): standard library only, Python 3.8+.

    python3 manifest.py BASE OUTPUT [OUTPUT...] [--cache FILE]

prints the manifest of the outputs (paths relative to BASE; a trailing "/"
marks a folder output) as JSON, or a message on stderr and exit status 1
when the tree is refused (``ManifestError``). docs/manifests.md describes
the format (``digest`` is the sha256 of the canonical JSON of ``entries``
alone, so equal trees give equal digests whatever cache was used) and what
is refused.

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

VERSION = 1
BUFFER_SIZE = 1 << 20  # one reusable 1 MiB read buffer per manifest
# files changed more recently than this are hashed but not cached (see above)
RACY_SECONDS = float(os.environ.get("SUBSTRAX_RACY_SECONDS", "2"))
MAX_LINK_HOPS = 40  # like the kernel's ELOOP limit
_LOOP = "too many levels of symbolic links"

_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK


class ManifestError(Exception):
    """The tree cannot be described safely (symlink escape, wrong kind of
    output, a file that changed while it was read, a bad output path)."""


# ----------------------------------------------------------------- hashing


class _Hasher(object):
    """sha256 of files read with one reusable buffer (readinto + memoryview)."""

    def __init__(self) -> None:
        self.buf = bytearray(BUFFER_SIZE)
        self.view = memoryview(self.buf)

    def file(self, path: str, st: os.stat_result) -> str:
        """The sha256 of the regular file `path`, which `st` (its lstat)
        describes. Opened without following links; refused if it is no
        longer the file `st` describes or if its size changes while read."""
        try:
            fd = os.open(path, _O_READ)
        except OSError as exc:
            raise ManifestError("cannot read %s: %s" % (path, exc.strerror or exc)) from exc
        with open(fd, "rb", buffering=0, closefd=True) as f:
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode) or fst.st_ino != st.st_ino or fst.st_dev != st.st_dev:
                raise ManifestError("%s was replaced while the manifest was taken" % path)
            h = hashlib.sha256()
            view = self.view
            readinto = f.readinto
            update = h.update
            total = 0
            while True:
                n = readinto(view)
                if not n:
                    break
                update(view[:n])
                total += n
        if total != st.st_size:
            raise ManifestError(
                "%s changed while it was read (%d bytes read, %d expected)" % (path, total, st.st_size)
            )
        return h.hexdigest()


# ----------------------------------------------------------------- symlinks


def _resolve(base: str, dir_parts: list, target: str, budget: list) -> tuple:
    """Where a link in the folder `dir_parts` (components relative to
    `base`) with text `target` leads, as ``(parts, None)``, or ``(None,
    why)`` if that cannot be told without leaving `base`.

    Resolved like the kernel would, one component at a time, but reading
    link text only (never following a link to read what it points at): a
    component that is itself a link is replaced by where it leads, so a
    ``..`` after it climbs from there. `budget` ([hops left]) bounds the
    links taken, like the kernel's ELOOP."""
    if target.startswith("/"):
        return None, "its target is absolute"
    parts = list(dir_parts)
    for name in target.split("/"):
        if name in ("", "."):
            continue
        if name == "..":
            if not parts:
                return None, "its target climbs out of the project"
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
                return None, _LOOP
            inner = os.readlink(os.path.join(base, *parts))
            resolved, why = _resolve(base, parts[:-1], inner, budget)
            if why == _LOOP:
                return None, _LOOP
            if why is not None:
                return None, "it goes through %s -> %s, and %s" % ("/".join(parts), inner, why)
            parts = resolved
    return parts, None


def _link_escape(base: str, out_parts: list, link_parts: list, target: str) -> str | None:
    """Why the link at `link_parts` (relative to `base`), with text
    `target`, leads outside the output `out_parts`; None if it stays in."""
    resolved, why = _resolve(base, link_parts[:-1], target, [MAX_LINK_HOPS])
    if why is not None:
        return why
    if resolved[: len(out_parts)] != out_parts:
        return "it leads to %s" % ("/".join(resolved) or ".")
    return None


# ----------------------------------------------------------------- building


def kind_of(mode: int) -> str:
    """What a file mode is, in words (also for messages on this side)."""
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def check_outputs(outputs: list) -> list:
    """[(relative path without trailing slash, is folder output)], refusing
    absolute paths, empty, "." and ".." components, and overlaps."""
    if isinstance(outputs, str):
        raise ManifestError("outputs must be a list of paths, not the string %r" % outputs)
    checked = []
    for out in outputs:
        if not isinstance(out, str) or not out:
            raise ManifestError("bad output path %r: expected a non-empty relative path" % (out,))
        is_dir = out.endswith("/")
        rel = out[:-1] if is_dir else out
        if out.startswith("/") or any(p in ("", ".", "..") for p in rel.split("/")):
            raise ManifestError(
                "bad output path %r: it must be relative to the project, without '.', '..' or '//'" % out
            )
        checked.append((rel, is_dir))
    # sorted by components, a path comes right before those under it
    ordered = sorted((rel.split("/"), rel, is_dir) for rel, is_dir in checked)
    for i in range(1, len(ordered)):
        a_parts, a, a_dir = ordered[i - 1]
        b_parts, b, b_dir = ordered[i]
        if b_parts[: len(a_parts)] == a_parts:
            raise ManifestError(
                "outputs %r and %r overlap: declare each path once" % (a + "/" * a_dir, b + "/" * b_dir)
            )
    return checked


def _check_parents(base: str, rel: str) -> bool:
    """True if every folder above the output exists as a real folder; False
    if one is missing. A link or a file on the way is refused (the output
    would not be where it is declared)."""
    parts = rel.split("/")[:-1]
    for i in range(len(parts)):
        sub = "/".join(parts[: i + 1])
        try:
            st = os.lstat(os.path.join(base, sub))
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            raise ManifestError(
                "output %s lies under %s, a symlink: refused, never followed" % (rel, sub)
            )
        if not stat.S_ISDIR(st.st_mode):
            raise ManifestError("output %s lies under %s, which is a %s" % (rel, sub, kind_of(st.st_mode)))
    return True


def build_manifest(
    base: str | os.PathLike, outputs: list, cache: dict | None = None, cache_young: bool = False
) -> dict:
    """The manifest of `outputs` (project-relative POSIX paths, a trailing
    "/" marking a folder) under the folder `base`. Missing outputs are listed
    in "missing"; anything that cannot be described safely raises
    ManifestError, and so does a tree that cannot be read or changes under
    the walk. `cache` (rel path -> [size, mtime_ns, ctime_ns, ino, dev, sha256]) is
    read and updated in place. `cache_young` caches files younger than RACY_SECONDS
    too: only for a cache whose every hit is checked again later (the run's
    side of a fetch, whose copy is hashed whole here)."""
    base = os.fspath(base)
    checked = check_outputs(outputs)
    try:
        manifest = _build(base, checked, cache, cache_young)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else base
        raise ManifestError(
            "cannot read %s: %s (did it change while the manifest was taken?)"
            % (where, exc.strerror or exc)
        ) from exc
    manifest["digest"] = entries_digest(manifest["entries"])
    return manifest


def _build(base: str, checked: list, cache: dict | None, cache_young: bool = False) -> dict:
    entries: list = []
    missing: list = []
    hasher: _Hasher | None = None
    racy_ns = (time.time_ns() + 1) if cache_young else time.time_ns() - int(RACY_SECONDS * 1e9)
    cache_get = cache.get if cache is not None else None
    seen: set | None = set() if cache is not None else None
    add = entries.append
    S_ISDIR, S_ISREG, S_ISLNK = stat.S_ISDIR, stat.S_ISREG, stat.S_ISLNK

    def file_entry(path: str, rel: str, st: os.stat_result) -> dict:
        nonlocal hasher
        size = st.st_size
        key = [size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
        if cache_get is not None:
            hit = cache_get(rel)
            if isinstance(hit, list) and hit[:5] == key and len(hit) == 6:
                seen.add(rel)  # type: ignore[union-attr]
                return {"path": rel, "type": "file", "size": size, "mode": st.st_mode & 0o7777,
                        "sha256": hit[5], "target": None}
        if hasher is None:
            hasher = _Hasher()
        digest = hasher.file(path, st)
        if cache is not None:
            # the racy rule: a file changed inside the window is not remembered
            if st.st_ctime_ns < racy_ns:
                cache[rel] = key + [digest]
                seen.add(rel)  # type: ignore[union-attr]
            elif rel in cache:
                del cache[rel]
        return {"path": rel, "type": "file", "size": size, "mode": st.st_mode & 0o7777,
                "sha256": digest, "target": None}

    def link_entry(path: str, rel: str, out_parts: list, parts: list) -> dict:
        target = os.readlink(path)
        why = _link_escape(base, out_parts, parts, target)
        if why == _LOOP:
            raise ManifestError(
                "symlink %s -> %s is a loop (%s): refused, never followed" % (rel, target, why)
            )
        if why is not None:
            raise ManifestError(
                "symlink %s -> %s points outside its output (%s): refused, never followed"
                % (rel, target, why)
            )
        return {"path": rel, "type": "symlink", "size": len(os.fsencode(target)), "mode": 0o777,
                "sha256": None, "target": target}

    for rel, is_dir in checked:
        top = os.path.join(base, rel)
        try:
            st = os.lstat(top) if _check_parents(base, rel) else None
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None:
            missing.append(rel + "/" if is_dir else rel)
            continue
        mode = st.st_mode
        if is_dir:
            if not S_ISDIR(mode):
                raise ManifestError(
                    "output %s/ is declared as a folder but is a %s%s"
                    % (rel, kind_of(mode), ": refused, never followed" if S_ISLNK(mode) else "")
                )
        elif S_ISDIR(mode):
            raise ManifestError(
                "output %s is declared as a file but is a folder: declare it as %s/" % (rel, rel)
            )
        elif S_ISLNK(mode):
            target = os.readlink(top)
            raise ManifestError(
                "output %s is a symlink -> %s, which points outside the output: refused, never followed"
                % (rel, target)
            )
        elif S_ISREG(mode):
            add(file_entry(top, rel, st))
            continue
        else:
            raise ManifestError("output %s is a %s, not a file" % (rel, kind_of(mode)))

        add({"path": rel, "type": "dir", "size": 0, "mode": mode & 0o7777, "sha256": None, "target": None})
        out_parts = rel.split("/")
        stack: list = [(top, rel, out_parts)]
        while stack:
            dir_abs, dir_rel, dir_parts = stack.pop()
            try:
                it = os.scandir(dir_abs)
            except OSError as exc:
                raise ManifestError("cannot list %s: %s" % (dir_rel, exc.strerror or exc)) from exc
            with it:
                for de in it:
                    name = de.name
                    erel = dir_rel + "/" + name
                    path = de.path
                    est = de.stat(follow_symlinks=False)
                    emode = est.st_mode
                    if S_ISREG(emode):
                        add(file_entry(path, erel, est))
                    elif S_ISDIR(emode):
                        add({"path": erel, "type": "dir", "size": 0, "mode": emode & 0o7777,
                             "sha256": None, "target": None})
                        stack.append((path, erel, dir_parts + [name]))
                    elif S_ISLNK(emode):
                        add(link_entry(path, erel, out_parts, dir_parts + [name]))
                    else:
                        raise ManifestError(
                            "%s is a %s: outputs may hold only files, folders and symlinks"
                            % (erel, kind_of(emode))
                        )

    if cache is not None:
        _prune(cache, checked, seen)  # type: ignore[arg-type]
    entries.sort(key=_path_key)
    return {"version": VERSION, "entries": entries, "missing": missing, "digest": None}


def _path_key(entry: dict) -> str:
    return entry["path"]


def _prune(cache: dict, checked: list, seen: set) -> None:
    """Forget cached files under these outputs that are no longer there."""
    if len(cache) == len(seen):
        return  # every key is a file just seen: nothing stale
    prefixes = tuple(rel + "/" for rel, is_dir in checked if is_dir)
    singles = set(rel for rel, is_dir in checked if not is_dir)
    stale = [k for k in cache if k not in seen and (k in singles or k.startswith(prefixes))]
    for k in stale:
        del cache[k]


def entries_digest(entries: list) -> str:
    """sha256 of the canonical JSON of a manifest's entries."""
    return hashlib.sha256(canonical_json(entries).encode()).hexdigest()


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# ----------------------------------------------------------------- CLI


def _load_cache_file(cache_file: str | None) -> dict:
    try:
        with open(cache_file or "") as f:
            loaded = json.load(f)
        return loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or unreadable: a good one is written


def manifest_with_cache_file(base: str, outputs: list, cache_file: str | None) -> dict:
    """build_manifest with its hash cache kept in a JSON file (the worker
    fills it at the end of a run, so a fetch's manifest costs stats only).
    Used only where the run ran: the fetched copy is hashed whole on this
    side, so a stale entry can only make a fetch refused, never accepted,
    and young files are cached too. The file is rewritten only if the cache
    changed."""
    cache = _load_cache_file(cache_file)
    before = dict(cache)
    manifest = build_manifest(base, outputs, cache, cache_young=True)
    if cache_file and (cache != before or not os.path.exists(cache_file)):
        tmp = "%s.%d.tmp" % (cache_file, os.getpid())
        with open(tmp, "w") as f:
            json.dump(cache, f, separators=(",", ":"))
        os.replace(tmp, cache_file)
    return manifest


def main(argv: list | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cache_file = None
    if "--cache" in args:
        at = args.index("--cache")
        cache_file = args[at + 1] if at + 1 < len(args) else None
        del args[at : at + 2]
    if len(args) < 2 or args[0] in ("-h", "--help") or ("--cache" in (argv or sys.argv) and not cache_file):
        sys.stderr.write("usage: manifest.py BASE OUTPUT [OUTPUT...] [--cache FILE]\n")
        return 2
    base = args[0]
    if not os.path.isdir(base):
        sys.stderr.write("manifest.py: %s is not a folder\n" % base)
        return 1
    try:
        manifest = manifest_with_cache_file(base, args[1:], cache_file)
    except ManifestError as exc:
        sys.stderr.write("manifest.py: %s\n" % exc)
        return 1
    sys.stdout.write(canonical_json(manifest) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
