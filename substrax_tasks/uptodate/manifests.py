"""Local use of `remote/manifest.py`: verify outputs against a manifest.

There is one implementation of manifests, the stdlib-only `remote/manifest.py`
that also runs on the remote machine; this module imports that very file (as
``substrax_tasks._remote.manifest``) and adds what only this side needs:

* `HashCache`: the per-file hash cache (rel path -> the packed record of
  its size, mtime_ns, ctime_ns, inode, device and sha256,
  `remote_manifest.cache_record`) kept in a JSON file (mode 0600, written
  atomically, only when it changed). Any miss hashes the file.
* `verify_outputs`: the differences between the outputs and a manifest.
* `outputs_match`: whether the outputs still have a manifest's digest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.atomic import write_json_atomic

# 2: entries keyed on ctime and device too; 3: each entry the hex of its
# packed record (remote_manifest.cache_record), not a list: 105 bytes a file
# held, not 450. A version 2 file is read and converted.
CACHE_VERSION = 3
_LIST_VERSION = 2
_HEX_SIZE = 2 * remote_manifest.RECORD_SIZE

CacheEntries = dict[str, bytes]
Manifest = dict[str, Any]

ManifestError = remote_manifest.ManifestError


def build_manifest(
    base: str | os.PathLike[str], outputs: Sequence[str], cache: CacheEntries | None = None
) -> Manifest:
    """`remote/manifest.py`'s `build_manifest` (see there)."""
    return remote_manifest.build_manifest(base, outputs, cache)


def read_manifest_file(path: Path) -> Manifest | None:
    """The manifest in the file `path`, read a window at a time, its
    entries packed (`remote_manifest.PackedEntries`: ~70 bytes a file held,
    where a dict per entry took 590); None if the file is missing,
    unreadable or not a manifest."""
    try:
        with path.open("rb") as f:
            manifest = remote_manifest.load_manifest(f)
    except (OSError, ValueError):
        return None
    return manifest if "digest" in manifest and isinstance(manifest.get("entries"), Sequence) else None


def _record_of(value: object, *, hexed: bool) -> bytes | None:
    """The record a cache file's entry holds: (version 3) the hex of the
    record, or (version 2) [size, mtime_ns, ctime_ns, inode, device, sha256
    hex]; None if it is not one (then the file is hashed again)."""
    try:
        if hexed:
            return bytes.fromhex(value) if isinstance(value, str) and len(value) == _HEX_SIZE else None
        if (
            isinstance(value, list)
            and len(value) == 6
            and all(type(v) is int for v in value[:5])
            and isinstance(value[5], str)
            and len(value[5]) == 64
        ):
            return remote_manifest.stat_key_of(*value[:5]) + bytes.fromhex(value[5])
    except (ValueError, OverflowError):  # not hex, or a value no stat gives
        pass
    return None


class _HexEntries:
    """A hash cache's entries as its file says them, `json_pieces` at a
    time (atomic.write_json_atomic): the hex of each record, never a copy
    of the whole cache in text."""

    def __init__(self, entries: Mapping[str, bytes]) -> None:
        self.entries = entries

    def json_pieces(self) -> Iterator[str]:
        names = sorted(self.entries)
        yield "{"
        chunk = remote_manifest.DIGEST_CHUNK
        for start in range(0, len(names), chunk):
            part = {name: self.entries[name].hex() for name in names[start : start + chunk]}
            yield ("," if start else "") + json.dumps(part, sort_keys=True, separators=(",", ":"))[1:-1]
        yield "}"


class _Entries(dict[str, bytes]):
    """A hash cache's entries, noting whether one changed. The walk changes
    them only by item assignment, `pop` and `del` (remote/manifest.py); a
    copy kept to compare with instead cost a dict slot per file."""

    changed = False

    def __setitem__(self, key: str, value: bytes) -> None:
        if self.get(key) != value:
            self.changed = True
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.changed = True
        super().__delitem__(key)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            self.changed = True
        return super().pop(key, *default)

    def _refused(self, *_args: Any, **_kwargs: Any) -> None:
        raise TypeError("a hash cache's entries change by item assignment, pop and del only")

    update = setdefault = popitem = clear = __ior__ = _refused  # type: ignore[assignment]


class HashCache:
    """The hash cache of a step's files, kept in a JSON file, paths relative
    to the base folder. A missing, unreadable or other-version file loads as
    an empty cache (a cache can always be rebuilt); `save` writes atomically
    with mode 0600, and only if something changed since `load`."""

    def __init__(self, path: Path, entries: Mapping[str, bytes] | None = None) -> None:
        self.path = path
        self.entries: CacheEntries = _Entries(entries or {})
        self._on_disk = False  # the file holds exactly these entries

    @classmethod
    def load(cls, path: Path) -> HashCache:
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return cls(path)
        version = data.get("version") if isinstance(data, dict) else 0
        raw = data.get("entries") if version in (CACHE_VERSION, _LIST_VERSION) else None
        if not isinstance(raw, dict):
            return cls(path)
        cache, listed = cls(path), len(raw)
        for rel in list(raw):  # each popped: the file's text and the records are never both whole
            record = _record_of(raw.pop(rel), hexed=version == CACHE_VERSION)
            if record is not None:
                dict.__setitem__(cache.entries, rel, record)
        # a version 2 file, or bad entries dropped: rewritten at the next save
        cache._on_disk = version == CACHE_VERSION and len(cache.entries) == listed
        return cache

    @property
    def changed(self) -> bool:
        """Something to write: the file is missing or stale, or an entry changed."""
        return not self._on_disk or cast("_Entries", self.entries).changed

    def save(self) -> None:
        if not self.changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # compact: a cache of 20,000 files is 2 MB, 4x slower to indent
        data = {"version": CACHE_VERSION, "entries": _HexEntries(self.entries)}
        write_json_atomic(self.path, data, indent=None)
        self._on_disk = True
        cast("_Entries", self.entries).changed = False


def _manifest_cached(
    base: str | os.PathLike[str], outputs: Sequence[str], cache_file: Path | HashCache
) -> Manifest:
    cache = cache_file if isinstance(cache_file, HashCache) else HashCache.load(cache_file)
    try:
        return remote_manifest.build_manifest(base, outputs, cache.entries)
    finally:
        cache.save()


def _digest_cached(
    base: str | os.PathLike[str], outputs: Sequence[str], cache_file: Path | HashCache
) -> tuple[str, list[str]]:
    """(digest, missing) of the outputs' manifest, its entries never held."""
    cache = cache_file if isinstance(cache_file, HashCache) else HashCache.load(cache_file)
    try:
        return remote_manifest.tree_digest(base, outputs, cache.entries)
    finally:
        cache.save()


def verify_outputs(
    base: str | os.PathLike[str],
    outputs: Sequence[str],
    expected_manifest: Mapping[str, Any],
    cache_file: Path | HashCache,
) -> list[str]:
    """The differences between the outputs under `base` and
    `expected_manifest`; empty means verified. The hash cache is read from
    `cache_file`, or is the one given (then saved). A tree refused by the
    manifest (a symlink escape, an output of the wrong kind) and an output
    that is missing, or was already missing when `expected_manifest` was
    taken, are differences too."""
    never = list(expected_manifest.get("missing", []))
    try:
        # the digest alone first: a copy that verifies (the usual case)
        # never holds its manifest's entries
        digest, missing = _digest_cached(base, outputs, cache_file)
        if digest == expected_manifest.get("digest") and not never and not missing:
            return []
        actual = _manifest_cached(base, outputs, cache_file)  # to name the differences
    except remote_manifest.ManifestError as exc:
        return [f"refused: {exc}"]
    same = actual["digest"] == expected_manifest.get("digest")
    problems = [f"output never produced: {out}" for out in never]
    problems += [f"missing output: {out}" for out in actual["missing"] if out not in never]

    problems += diff_manifests(expected_manifest, actual)
    if not problems and not same:
        # equal entries but another digest: the record itself is damaged
        recorded = remote_manifest.entries_digest(list(expected_manifest["entries"]))
        problems.append(
            f"the expected manifest's digest {expected_manifest.get('digest')!r} does not match its "
            f"own entries ({recorded}): the record is damaged"
        )
    return problems


def outputs_match(
    base: str | os.PathLike[str], outputs: Sequence[str], expected_digest: str, cache_file: Path
) -> bool:
    """True if every output exists and their manifest has `expected_digest`;
    a tree the manifest refuses does not match."""
    try:
        digest, missing = _digest_cached(base, outputs, cache_file)
    except remote_manifest.ManifestError:
        return False
    return not missing and digest == expected_digest


def renamed_into_place(base: str | os.PathLike[str], outputs: Sequence[str], cache_file: Path) -> None:
    """After the promotion renamed outputs just verified into place: a
    rename gives a file a new ctime and changes nothing else, so each file
    output whose hash cache entry still matches its size, mtime, inode and
    device takes its new ctime (else every later check would hash it again;
    a folder's files keep their ctime when it is renamed)."""
    files = [out for out in outputs if not out.endswith("/")]
    if not files:
        return
    cache = HashCache.load(cache_file)
    for out in files:
        hit = cache.entries.get(out)
        try:
            st = (Path(base) / out).lstat()
        except OSError:
            continue
        if hit is None:
            continue
        (size, mtime_ns, _ctime_ns, inode, device), digest = remote_manifest.record_values(hit)
        if [size, mtime_ns, inode, device] == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]:
            cache.entries[out] = remote_manifest.cache_record(remote_manifest.stat_key(st), digest)
    cache.save()


# ---- the differences between two manifests, as verification and `why` name them


def _under(path: str, folders: list[str]) -> str | None:
    """The folder of `folders` (a stack of ancestors-so-far) holding `path`."""
    while folders and not path.startswith(folders[-1] + "/"):
        folders.pop()
    return folders[-1] if folders else None


def _collapsed(paths: list[str], by_path: Mapping[str, Any], label: str) -> list[tuple[str, str]]:
    """[(path, 'missing: path ...')], one per topmost path: a folder's
    contents are counted on its line rather than listed."""
    inside: dict[str, int] = {}  # each topmost path: how many entries it holds
    folders: list[str] = []
    for path in paths:  # sorted, so a folder comes right before its contents
        top = _under(path, folders)
        if top is not None:
            inside[top] += 1
            continue
        inside[path] = 0
        if by_path[path]["type"] == "dir":
            folders.append(path)
    out = []
    for path, n in inside.items():
        kind = by_path[path]["type"]
        more = f" (and the {n} entries inside it)" if n else ""
        out.append((path, f"{label}: {path}{'/' if kind == 'dir' else ''} ({kind}){more}"))
    return out


def _short(digest: str | None) -> str:
    return (digest or "-")[:12]


def diff_manifests(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two manifests, each naming its
    path: missing, extra, changed type, changed content (file hash or size,
    link target) and changed mode. Empty when the entries are equal. A folder
    missing (or extra) as a whole is one line that counts what it held."""
    exp = {e["path"]: e for e in expected["entries"]}
    act = {e["path"]: e for e in actual["entries"]}
    sorted_exp = sorted(exp)
    gone = [p for p in sorted_exp if p not in act]
    new = [p for p in sorted(act) if p not in exp]
    lines = _collapsed(gone, exp, "missing") + _collapsed(new, act, "extra")
    for path in sorted_exp:
        a = act.get(path)
        if a is None:
            continue
        e = exp[path]
        if e["type"] != a["type"]:
            lines.append((path, f"changed type: {path} ({e['type']} -> {a['type']})"))
            continue
        if e["type"] == "file" and (e["sha256"] != a["sha256"] or e["size"] != a["size"]):
            was = f"{e['size']} bytes, sha256 {_short(e['sha256'])}"
            now = f"{a['size']} bytes, sha256 {_short(a['sha256'])}"
            lines.append((path, f"changed content: {path} ({was} -> {now})"))
        elif e["type"] == "symlink" and e["target"] != a["target"]:
            lines.append((path, f"changed content: {path} (symlink -> {e['target']}, now -> {a['target']})"))
        if e["mode"] != a["mode"]:
            lines.append((path, f"changed mode: {path} ({e['mode']:04o} -> {a['mode']:04o})"))
    lines.sort(key=lambda pair: pair[0])
    return [line for _, line in lines]
