"""Local use of `remote/manifest.py`: verify outputs against a manifest.

There is one implementation of manifests, the stdlib-only `remote/manifest.py`
that also runs on the remote machine; this module loads that very file (as the
module ``substrax_remote_manifest``) and adds what only this side needs:

* `HashCache`: the per-file hash cache (rel path -> [size, mtime_ns,
  ctime_ns, inode, device, sha256]) kept in a JSON file (mode 0600, written
  atomically, only when it changed). Any miss hashes the file.
* `verify_outputs`: the differences between the outputs and a manifest.
* `outputs_match`: whether the outputs still have a manifest's digest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends.scripts import remote_module

CACHE_VERSION = 2  # 2: entries keyed on ctime and device too

CacheEntries = dict[str, list[Any]]
Manifest = dict[str, Any]


if TYPE_CHECKING:

    class ManifestModule(Protocol):
        """The parts of `remote/manifest.py` used here."""

        RACY_SECONDS: float
        ManifestError: type[Exception]

        def build_manifest(
            self, base: str | os.PathLike[str], outputs: Sequence[str], cache: CacheEntries | None = None
        ) -> Manifest: ...

        def check_outputs(self, outputs: Sequence[str]) -> list[tuple[str, bool]]: ...

        def entries_digest(self, entries: list[dict[str, Any]]) -> str: ...

        def hash_file(self, path: str, st: os.stat_result, buf: memoryview) -> str: ...


def manifest_module() -> ManifestModule:
    """`remote/manifest.py`, loaded once (as `substrax_remote_manifest`)."""
    return cast("ManifestModule", remote_module("manifest"))


ManifestError: type[Exception] = manifest_module().ManifestError


def build_manifest(
    base: str | os.PathLike[str], outputs: Sequence[str], cache: CacheEntries | None = None
) -> Manifest:
    """`remote/manifest.py`'s `build_manifest` (see there)."""
    return manifest_module().build_manifest(base, outputs, cache)


def _valid_entry(value: object) -> bool:
    """[size, mtime_ns, ctime_ns, inode, device, sha256 hex]"""
    return (
        isinstance(value, list)
        and len(value) == 6
        and all(type(v) is int for v in value[:5])
        and isinstance(value[5], str)
        and len(value[5]) == 64
    )


class HashCache:
    """The hash cache of a step's files, kept in a JSON file, paths relative
    to the base folder. A missing, unreadable or other-version file loads as
    an empty cache (a cache can always be rebuilt); `save` writes atomically
    with mode 0600, and only if something changed since `load`."""

    def __init__(self, path: Path, entries: Mapping[str, list[Any]] | None = None) -> None:
        self.path = path
        self.entries: CacheEntries = dict(entries or {})
        self._saved: CacheEntries | None = None  # what the file holds, when it holds exactly that

    @classmethod
    def load(cls, path: Path) -> HashCache:
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return cls(path)
        raw = data.get("entries") if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None
        if not isinstance(raw, dict):
            return cls(path)
        cache = cls(path, {k: v for k, v in raw.items() if _valid_entry(v)})
        if len(cache.entries) == len(raw):  # else rewrite it without the bad ones
            cache._saved = dict(cache.entries)
        return cache

    @property
    def changed(self) -> bool:
        """Something to write: the file is missing or stale, or an entry changed."""
        return self.entries != self._saved

    def save(self) -> None:
        if not self.changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # compact: a cache of 20,000 files is 2 MB, 4x slower to indent
        write_json_atomic(self.path, {"version": CACHE_VERSION, "entries": self.entries}, indent=None)
        self._saved = dict(self.entries)


def _manifest_cached(
    base: str | os.PathLike[str], outputs: Sequence[str], cache_file: Path | HashCache
) -> Manifest:
    cache = cache_file if isinstance(cache_file, HashCache) else HashCache.load(cache_file)
    try:
        return manifest_module().build_manifest(base, outputs, cache.entries)
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
    mod = manifest_module()
    try:
        actual = _manifest_cached(base, outputs, cache_file)
    except mod.ManifestError as exc:
        return [f"refused: {exc}"]
    never = list(expected_manifest.get("missing", []))
    same = actual["digest"] == expected_manifest.get("digest")
    if same and not never and not actual["missing"]:
        return []
    problems = [f"output never produced: {out}" for out in never]
    problems += [f"missing output: {out}" for out in actual["missing"] if out not in never]

    problems += diff_manifests(expected_manifest, actual)
    if not problems and not same:
        # equal entries but another digest: the record itself is damaged
        recorded = mod.entries_digest(list(expected_manifest["entries"]))
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
        manifest = _manifest_cached(base, outputs, cache_file)
    except manifest_module().ManifestError:
        return False
    return not manifest["missing"] and manifest["digest"] == expected_digest


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
        if hit is not None and hit[:2] + hit[3:5] == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]:
            cache.entries[out] = [*hit[:2], st.st_ctime_ns, *hit[3:]]
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
