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

The optional ``cache`` maps a relative path to a packed record of ``size,
mtime_ns, ctime_ns, inode, device, sha256`` (`cache_record`, 72 bytes: a
list of five ints and the hex digest took 450 bytes a file): a file whose
lstat gives those five values is not read. ctime is in the key because nothing short of moving the clock back
sets it back (``os.utime`` moves it). A file whose ctime is younger than
``RACY_SECONDS`` is hashed but not cached: a second write in the same tick
would leave every value unchanged (git's "racily clean" problem). The cache
is changed only by item assignment, ``pop`` and ``del`` (substrax_tasks/
manifest_cache.py tracks changes that way).
"""

from __future__ import annotations

import codecs
import contextlib
import difflib
import hashlib
import io
import itertools
import json
import os
import stat
import struct
import sys
import time
from array import array
from typing import IO, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union, overload

VERSION = 1
BUFFER_SIZE = 1 << 20
# files changed more recently than this are hashed but not cached (see above)
RACY_SECONDS = float(os.environ.get("SUBSTRAX_RACY_SECONDS", "2"))
MAX_LINK_HOPS = 40  # like the kernel's ELOOP limit
_LOOP = "too many levels of symbolic links"
_O_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK

Entry = Dict[str, Any]
Cache = Dict[str, bytes]

# a hash cache's record: size, mtime_ns, ctime_ns, inode, device, then the
# sha256's 32 bytes
_STAT_KEY = struct.Struct("<QqqQQ")
RECORD_SIZE = _STAT_KEY.size + 32


def stat_key(st: os.stat_result) -> bytes:
    """The packed stat values a hash cache record starts with: any write
    changes them."""
    return _STAT_KEY.pack(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def stat_key_of(size: int, mtime_ns: int, ctime_ns: int, inode: int, device: int) -> bytes:
    """`stat_key` of these values; ValueError if no stat gives them."""
    try:
        return _STAT_KEY.pack(size, mtime_ns, ctime_ns, inode, device)
    except struct.error as exc:
        raise ValueError("not a file's stat: %s" % exc) from None


def cache_record(key: bytes, digest: str) -> bytes:
    """A hash cache's record of a file: its `stat_key` and its sha256 (hex)."""
    return key + bytes.fromhex(digest)


def cached_digest(record: Optional[bytes], key: bytes) -> Optional[str]:
    """The sha256 (hex) `record` holds if it is of a file whose `stat_key`
    is `key`, else None."""
    if isinstance(record, bytes) and len(record) == RECORD_SIZE and record.startswith(key):
        return record[_STAT_KEY.size:].hex()
    return None


def record_values(record: bytes) -> Tuple[List[int], str]:
    """([size, mtime_ns, ctime_ns, inode, device], sha256 hex) of a record."""
    return list(_STAT_KEY.unpack_from(record)), record[_STAT_KEY.size:].hex()


class ManifestError(Exception):
    """The tree cannot be described safely (symlink escape, wrong kind of
    output, a file that changed while it was read, a bad output path)."""


# A helper that works long (hashing a big tree, copying a snapshot,
# building an environment) writes PROGRESS_LINE on stderr at least every
# $SUBSTRAX_PROGRESS_SECONDS while it works, when the client that runs it
# asks so (it sets that variable): the client gives up on its answer only
# after a quiet spell (QUIET_ANSWER_SECONDS in substrax_tasks/backends/
# remote_run.py), never after a fixed time that a big legitimate tree
# would pass. Nothing is written otherwise: the worker and the client hash
# with this module too, and a SkyPilot job's setup builds its environment
# into the job's log.
PROGRESS_LINE = b"substrax-progress\n"
PROGRESS_VARIABLE = "SUBSTRAX_PROGRESS_SECONDS"
# For tests only: seconds each file's hash is made to take (a slow disk),
# spent in steps that report progress.
_TEST_HASH_PAUSE = float(os.environ.get("SUBSTRAX_TEST_HASH_PAUSE") or 0)


class Progress:
    """The progress lines of a long helper (PROGRESS_LINE)."""

    def __init__(self) -> None:
        self.every = 0.0  # seconds between lines; 0: none asked for
        self.last = 0.0

    def start(self) -> None:
        """Lines from now on, if the client asked for them."""
        try:
            self.every = max(float(os.environ.get(PROGRESS_VARIABLE) or 0), 0.0)
        except ValueError:
            self.every = 0.0
        self.last = time.monotonic()

    def tick(self) -> None:
        """Called often while working: a line once `every` seconds went by."""
        if self.every and time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            sys.stderr.buffer.write(PROGRESS_LINE)
            sys.stderr.flush()


PROGRESS = Progress()


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
        for _ in range(int(_TEST_HASH_PAUSE * 10)):
            time.sleep(0.1)
            PROGRESS.tick()
        for n in iter(lambda: f.readinto(buf), 0):
            h.update(buf[:n])
            total += n
            PROGRESS.tick()
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
    missing, rows = _walk(base, check_outputs(outputs), cache)
    with _read_errors(base):
        entries = list(rows)
    taken = {"version": VERSION, "entries": entries, "missing": missing, "digest": entries_digest(entries)}
    near = near_names(base, missing, outputs)
    if near:
        taken["near"] = near
    return taken


def near_names(base: str, missing: Sequence[str], outputs: Sequence[str]) -> Dict[str, List[str]]:
    """For each missing output, the names written where it should be that
    look like it (``out/reslt.txt`` for ``out/result.txt``): a typo in the
    command or in ``outputs=`` is then named, not only the absence. Only
    the first missing component of the path is compared, among the names of
    the deepest folder above it that exists; declared outputs are never
    offered."""
    declared = {o.rstrip("/") for o in outputs}
    near: Dict[str, List[str]] = {}
    for out in missing:
        parts = out.rstrip("/").split("/")
        depth = len(parts) - 1
        while depth > 0 and not os.path.isdir(os.path.join(base, *parts[:depth])):
            depth -= 1
        folder = os.path.join(base, *parts[:depth]) if depth else base
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        prefix = "".join(p + "/" for p in parts[:depth])
        found = [prefix + n for n in difflib.get_close_matches(parts[depth], names, n=3, cutoff=0.75)]
        found = [f for f in found if f not in declared]
        if found:
            near[out] = found
    return near


def tree_digest(base: str | os.PathLike[str], outputs: Sequence[str], cache: Optional[Cache] = None
                ) -> Tuple[str, List[str]]:
    """(digest, missing) of the manifest `build_manifest` would return, taken
    without holding its entries: the walk yields them in order and they are
    hashed as they come, so verifying a tree costs memory per folder, not
    per file (a dict of six keys is ~500 bytes; 200,000 files held 100 MB)."""
    base = os.fspath(base)
    missing, rows = _walk(base, check_outputs(outputs), cache)
    with _read_errors(base):
        digest = _digest_of(rows)
    return digest, missing


# one name of a folder's listing: sort key, name, listed as a folder, True
# for "the folder's contents" (then its key ends with "/"), its output's
# path components
Listed = Tuple[str, str, bool, bool, List[str]]


@contextlib.contextmanager
def _read_errors(base: str) -> Iterator[None]:
    """An OSError of the walk, as the ManifestError that names it."""
    try:
        yield
    except OSError as exc:
        raise ManifestError("cannot read %s: %s (did it change while the manifest was taken?)" % (
            base if exc.filename is None else exc.filename, exc.strerror or exc)) from exc


def _walk(base: str, checked: List[Tuple[str, bool]], cache: Optional[Cache]
          ) -> Tuple[List[str], Iterator[Entry]]:
    """(missing outputs, the entries under the others in path order). The
    outputs themselves are checked here; what lies under them as the rows
    are drawn, which may raise ManifestError or OSError."""
    missing: List[str] = []
    tops: List[Listed] = []
    with _read_errors(base):
        for rel, is_dir in checked:
            st = _lstat_output(base, rel)
            if st is None:
                missing.append(rel + "/" if is_dir else rel)
                continue
            if is_dir and not stat.S_ISDIR(st.st_mode):
                link = stat.S_ISLNK(st.st_mode)
                raise ManifestError("output %s/ is declared as a folder but is a %s%s" % (
                    rel, kind_of(st.st_mode), ": refused, never followed" if link else ""))
            if not is_dir and stat.S_ISDIR(st.st_mode):
                raise ManifestError(
                    "output %s is declared as a file but is a folder: declare it as %s/" % (rel, rel))
            if not is_dir and stat.S_ISLNK(st.st_mode):
                raise ManifestError("output %s is a symlink -> %s, which points outside the output: refused, "
                                    "never followed" % (rel, os.readlink(os.path.join(base, rel))))
            if not is_dir and not stat.S_ISREG(st.st_mode):
                raise ManifestError("output %s is a %s, not a file" % (rel, kind_of(st.st_mode)))
            out_parts = rel.split("/")
            tops.append((rel, rel, is_dir, False, out_parts))
            if is_dir:
                tops.append((rel + "/", rel, is_dir, True, out_parts))
    return missing, _rows(base, checked, tops, cache)


def _rows(base: str, checked: List[Tuple[str, bool]], tops: List[Listed], cache: Optional[Cache]
          ) -> Iterator[Entry]:
    """The entries, sorted by path as strings, one folder listed at a time.
    A folder's own entry sorts by its name and its contents by its name and
    "/", among its siblings (`a`, `a-b`, `a.txt`, `a/x`): no sibling's path
    falls between two paths under it, so each folder's contents come out
    whole, at their place, from the folder's own sorted listing. A listing
    holds names only (a folder of 100,000 files would hold 100,000 stat
    results, and walks slower for it): each is taken with `lstat` when its
    turn comes, and refused if it is no longer of the kind listed."""
    buf = memoryview(bytearray(BUFFER_SIZE))  # one read buffer for every file of the manifest
    racy_ns = time.time_ns() - int(RACY_SECONDS * 1e9)
    seen = 0  # cached files seen: fewer than the cache holds means some are gone

    def row(path: str, rel: str, st: os.stat_result, out_parts: List[str]) -> Entry:
        nonlocal seen
        mode = st.st_mode
        if stat.S_ISREG(mode):
            key = stat_key(st)
            digest = None if cache is None else cached_digest(cache.get(rel), key)
            if digest is not None:
                seen += 1
            else:
                digest = hash_file(path, st, buf)
                if cache is not None and st.st_ctime_ns < racy_ns:
                    cache[rel] = cache_record(key, digest)
                    seen += 1
                elif cache is not None:
                    cache.pop(rel, None)  # the racy rule: a file changed inside the window is not remembered
            return {"path": rel, "type": "file", "size": st.st_size, "mode": mode & 0o7777, "sha256": digest,
                    "target": None}
        if stat.S_ISDIR(mode):
            return {"path": rel, "type": "dir", "size": 0, "mode": mode & 0o7777, "sha256": None,
                    "target": None}
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
        return {"path": rel, "type": "symlink", "size": len(os.fsencode(target)), "mode": 0o777,
                "sha256": None, "target": target}

    tops.sort(key=lambda item: item[0])
    # each folder being listed: (its path + "/", its relative path + "/", its sorted listing)
    stack = [(os.path.join(base, ""), "", iter(tops))]
    while stack:
        prefix, rel_prefix, listing = stack[-1]
        item = next(listing, None)
        if item is None:
            stack.pop()
            continue
        _key, name, listed_dir, contents, out_parts = item
        path, rel = prefix + name, rel_prefix + name
        if not contents:
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) != listed_dir:
                raise ManifestError("%s changed while the manifest was taken (it is %sa folder now)"
                                    % (rel, "not " if listed_dir else ""))
            yield row(path, rel, st, out_parts)
            continue
        try:
            folder = os.scandir(path)
        except OSError as exc:
            raise ManifestError("cannot list %s: %s" % (rel, exc.strerror or exc)) from exc
        inside: List[Listed] = []
        with folder:
            for de in folder:
                is_dir = de.is_dir(follow_symlinks=False)  # from the listing, no lstat
                inside.append((de.name, de.name, is_dir, False, out_parts))
                if is_dir:
                    inside.append((de.name + "/", de.name, True, True, out_parts))
        inside.sort(key=lambda item: item[0])
        stack.append((path + "/", rel + "/", iter(inside)))
    if cache is not None and len(cache) != seen:
        _forget_gone(base, checked, cache, seen)


def _forget_gone(base: str, outputs: List[Tuple[str, bool]], cache: Cache, seen: int) -> None:
    """Drop the cache entries under `outputs` ((path, is folder)) whose file
    is no longer the one they describe (gone, or replaced), when there are
    more of them than the walk saw (`seen`)."""
    prefixes = tuple(rel + "/" for rel, is_dir in outputs if is_dir)
    singles = set(rel for rel, is_dir in outputs if not is_dir)
    under = [rel for rel in cache if rel in singles or rel.startswith(prefixes)]
    if len(under) == seen:
        return  # the others are another tree's
    for rel in under:
        try:
            st = os.lstat(os.path.join(base, rel))
        except OSError:
            del cache[rel]
            continue
        if not stat.S_ISREG(st.st_mode) or cached_digest(cache[rel], stat_key(st)) is None:
            del cache[rel]


DIGEST_CHUNK = 250  # entries encoded at a time (json builds 1 KB of fragments for each)


def entries_digest(entries: Sequence[Entry]) -> str:
    """sha256 of the canonical JSON of a manifest's entries."""
    if isinstance(entries, PackedEntries):
        return entries.digest()
    return _digest_of(iter(entries))


def _digest_of(entries: Iterator[Entry]) -> str:
    """sha256 of the canonical JSON of the list of `entries`, fed to the hash
    a chunk of entries at a time: the same bytes as the whole list encoded
    at once (a list's items are joined by ","), without holding them (6 MiB
    for 20,000 files, in text and bytes)."""
    digest = hashlib.sha256(b"[")
    first = True
    while True:
        chunk = list(itertools.islice(entries, DIGEST_CHUNK))
        if not chunk:
            break
        text = canonical_json(chunk)[1:-1]  # without its [ ]
        digest.update((text if first else "," + text).encode())
        first = False
    digest.update(b"]")
    return digest.hexdigest()


ENTRY_TYPES = ("file", "dir", "symlink")
_KINDS = {"file": 1, "dir": 2, "symlink": 3}  # 0: an entry kept as its canonical JSON
_TYPE_OF = {kind: name for name, kind in _KINDS.items()}
# an entry's record: kind, mode, size, the path's length and the extra's
# (file: the sha256's 32 bytes, symlink: the target), then path and extra
_RECORD = struct.Struct("<BHQHI")
_KEYS = frozenset(("path", "type", "size", "mode", "sha256", "target"))
_WINDOW = 1 << 20  # characters of a manifest's text decoded at a time


def _packed(entry: Entry) -> bytes:
    """The record of `entry`: compact when it is an entry this module
    makes (it decodes to an equal dict), else its canonical JSON."""
    kind = _KINDS.get(entry["type"], 0) if entry.keys() == _KEYS and isinstance(entry["type"], str) else 0
    mode, size, path = entry.get("mode"), entry.get("size"), entry.get("path")
    sha, target = entry.get("sha256"), entry.get("target")
    extra = b""
    if kind == 1 and isinstance(sha, str) and len(sha) == 64 and target is None:
        extra = _raw_sha(sha)
        kind = kind if extra else 0
    elif kind == 3 and isinstance(target, str) and sha is None:
        extra = target.encode("utf-8", "surrogatepass")
    elif kind != 2 or sha is not None or target is not None:
        kind = 0
    if kind and type(mode) is int and 0 <= mode <= 0xFFFF and type(size) is int \
            and 0 <= size < 1 << 64 and isinstance(path, str):
        raw_path = path.encode("utf-8", "surrogatepass")
        if len(raw_path) <= 0xFFFF:
            return _RECORD.pack(kind, mode, size, len(raw_path), len(extra)) + raw_path + extra
    text = canonical_json(entry).encode()
    return _RECORD.pack(0, 0, 0, 0, len(text)) + text


def _raw_sha(sha: str) -> bytes:
    """The 32 bytes of a lower-case hex sha256, or b"" for any other text
    (which would not come back as it was)."""
    try:
        raw = bytes.fromhex(sha)
    except ValueError:
        return b""
    return raw if raw.hex() == sha else b""


def _unpacked(records: bytearray, at: int) -> Entry:
    """The entry whose record starts at `at` in `records`."""
    kind, mode, size, path_size, extra_size = _RECORD.unpack_from(records, at)
    start = at + _RECORD.size + path_size
    if kind == 0:
        entry: Entry = json.loads(records[start:start + extra_size])
        return entry
    path = records[at + _RECORD.size:start].decode("utf-8", "surrogatepass")
    extra = bytes(records[start:start + extra_size])
    return {"path": path, "type": _TYPE_OF[kind], "size": size, "mode": mode,
            "sha256": extra.hex() if kind == 1 else None,
            "target": extra.decode("utf-8", "surrogatepass") if kind == 3 else None}


class ManifestFormatError(ValueError):
    """A manifest document whose entries are not entries (`load_manifest`)."""


class PackedEntries(Sequence[Entry]):
    """A manifest's entries, each packed into one record of bytes (about
    70 bytes for a file, where a dict per entry took 590) and decoded when
    it is read. Its digest and its JSON are those of the list of entries.
    Read-only once made."""

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._records = bytearray()
        self._starts = array("Q")  # where each entry's record starts
        for entry in entries:
            self._append(entry)

    def _append(self, entry: Entry) -> None:
        self._starts.append(len(self._records))
        self._records += _packed(entry)

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, i: int) -> Entry: ...

    @overload
    def __getitem__(self, i: slice) -> List[Entry]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[Entry, List[Entry]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("entry index out of range")
        return _unpacked(self._records, self._starts[i])

    def __iter__(self) -> Iterator[Entry]:
        for start in self._starts:
            yield _unpacked(self._records, start)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedEntries):
            return self._records == other._records
        if isinstance(other, list):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))  # noqa: B905
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, like a list

    def __repr__(self) -> str:
        return "PackedEntries(<%d entries>)" % len(self)

    def digest(self) -> str:
        """sha256 of the canonical JSON of the entries."""
        return _digest_of(iter(self))

    def json_pieces(self) -> Iterator[str]:
        """The canonical JSON of the list of entries, DIGEST_CHUNK entries
        at a time."""
        yield "["
        entries = iter(self)
        first = True
        while True:
            chunk = list(itertools.islice(entries, DIGEST_CHUNK))
            if not chunk:
                break
            text = canonical_json(chunk)[1:-1]
            yield text if first else "," + text
            first = False
        yield "]"


def plain_entries(value: object) -> List[Entry]:
    """`json.dumps`'s ``default`` for a document that holds PackedEntries:
    the list of their entries, decoded."""
    if isinstance(value, PackedEntries):
        return list(value)
    raise TypeError("Object of type %s is not JSON serializable" % type(value).__name__)


class _Text:
    """A manifest's text read a window at a time: `at` in `text`, and
    `more` to read on (False at the end)."""

    def __init__(self, source: IO[bytes]) -> None:
        self.source = source
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.text, self.at, self.ended = "", 0, False

    def more(self) -> bool:
        if self.ended:
            return False
        chunk = self.source.read(_WINDOW)
        self.ended = not chunk
        self.text = self.text[self.at:] + self.decoder.decode(chunk, final=self.ended)
        self.at = 0
        return True

    def skip_space(self) -> None:
        while True:
            while self.at < len(self.text) and self.text[self.at] in " \t\n\r":
                self.at += 1
            if self.at < len(self.text) or not self.more():
                return

    def expect(self, char: str) -> None:
        self.skip_space()
        if self.text[self.at:self.at + 1] != char:
            raise ValueError("expected %r in the manifest" % char)
        self.at += 1

    def next_is(self, char: str) -> bool:
        self.skip_space()
        return self.text[self.at:self.at + 1] == char

    def value(self, decoder: json.JSONDecoder) -> Any:
        """The JSON value at `at`: one that ends at the window's end is
        taken only at the end of the text (a number may go on)."""
        self.skip_space()
        while True:
            try:
                found, end = decoder.raw_decode(self.text, self.at)
            except ValueError:
                if self.more():
                    continue
                raise
            if end < len(self.text) or not self.more():
                self.at = end
                return found


def load_manifest(data: Union[bytes, IO[bytes]], within: Optional[str] = None) -> Dict[str, Any]:
    """The manifest JSON document in `data` (or read from the binary file
    `data`, a window at a time), its entries packed (`PackedEntries`) as they
    are read: a dict per entry of 200,000 files held 120 MB, and their text
    30 MB. Each entry must be an object with a ``path`` and a ``type`` of
    ENTRY_TYPES (else ManifestFormatError, which says so); a document that
    is not a JSON object raises ValueError. Nothing else is checked (the
    digest is the caller's). With `within`, the document holds a manifest
    as the value of its key `within` (a run cache entry's "manifest"), and
    that manifest's entries are the ones packed."""
    text = _Text(io.BytesIO(data) if isinstance(data, bytes) else data)
    document = _read_object(text, json.JSONDecoder(), within)
    text.skip_space()
    if text.at < len(text.text):
        raise ValueError("text after the manifest")
    return document


def _read_object(text: _Text, decoder: json.JSONDecoder, within: Optional[str]) -> Dict[str, Any]:
    """The JSON object at `text`: a manifest, its entries packed, or (with
    `within`) a document holding one as the value of its key `within`."""
    document: Dict[str, Any] = {}
    text.expect("{")
    first = True
    while not text.next_is("}"):
        if not first:
            text.expect(",")
        first = False
        key = text.value(decoder)
        if not isinstance(key, str):
            raise ValueError("a manifest's keys are strings")
        text.expect(":")
        if within is not None and key == within and text.next_is("{"):
            document[key] = _read_object(text, decoder, None)
        elif within is None and key == "entries":
            document[key] = _read_entries(text, decoder)
        else:
            document[key] = text.value(decoder)
    text.expect("}")
    return document


def _read_entries(text: _Text, decoder: json.JSONDecoder) -> PackedEntries:
    entries = PackedEntries()
    if not text.next_is("["):
        raise ManifestFormatError("its entries are not a list of entries")
    text.expect("[")
    while not text.next_is("]"):
        if len(entries):
            text.expect(",")
        entry = text.value(decoder)
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ManifestFormatError("its entries are not a list of entries")
        if entry.get("type") not in ENTRY_TYPES:  # a device, fifo or socket is never an output
            raise ManifestFormatError("it lists %r as a %r: outputs are files, folders and symlinks"
                                      % (entry["path"], entry.get("type")))
        entries._append(entry)
    text.expect("]")
    return entries


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
    PROGRESS.start()
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
