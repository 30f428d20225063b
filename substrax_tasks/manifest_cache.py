"""Local use of `remote/manifest.py`: verify outputs, fast when nothing changed.

There is one implementation of manifests, the stdlib-only `remote/manifest.py`
that also runs on the remote machine; this module loads that very file (as the
module ``substrax_remote_manifest``) and adds what only this side needs:

* `HashCache`: the per-file hash cache (rel path -> [size, mtime_ns, ino,
  sha256]) kept in a JSON file (mode 0600, written atomically, only when it
  changed). Keep one cache file per step: its paths are relative to the base
  folder, and a file promoted from staging by a rename keeps its inode, size
  and mtime, so its cached hash is reused in the project.
* `verify_outputs`: the differences between the outputs and a manifest.
* `outputs_match`: the no-op check. Beside the cache file it keeps a small
  "stamp" file (``<cache file>.stamp``): the `tree_stamp` of the outputs when
  they last matched a digest. If the stamp is unchanged the digest is too, so
  an untouched tree costs one stat-only walk; otherwise the manifest is built
  (reusing cached hashes) and compared.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

from substrax_tasks._atomic import write_json_atomic
from substrax_tasks._remote_files import remote_script

MODULE_NAME = "substrax_remote_manifest"
CACHE_VERSION = 1

CacheEntries = dict[str, list[Any]]
Manifest = dict[str, Any]


if TYPE_CHECKING:  # a Protocol class costs a no-op doit ~0.5 ms to build

    class ManifestModule(Protocol):
        """The parts of `remote/manifest.py` used here."""

        VERSION: int
        RACY_SECONDS: int
        ManifestError: type[Exception]

        def build_manifest(
            self,
            base: str | os.PathLike[str],
            outputs: Sequence[str],
            cache: CacheEntries | None = None,
            *,
            cache_young: bool = False,
            digest: bool = True,
            stats: dict[Any, Any] | None = None,
            staged: Mapping[str, list[Any]] | None = None,
            clock: tuple[int, int] | None = None,
        ) -> Manifest: ...

        def fs_clock(self, near: str) -> tuple[int, int] | None: ...

        def diff_manifests(self, expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]: ...

        def tree_stamp(self, base: str | os.PathLike[str], outputs: Sequence[str]) -> tuple[str, int]: ...

        def stat_walk(
            self, base: str | os.PathLike[str], outputs: Sequence[str], items: list[Any],
            any_folder: bool = False,
        ) -> int: ...

        def stamp_of(self, items: list[Any]) -> str: ...

        def entries_digest(self, entries: list[dict[str, Any]]) -> str: ...

        def kind_of(self, mode: int) -> str: ...


_load_lock = threading.Lock()


def manifest_module() -> ManifestModule:
    """`remote/manifest.py`, loaded once and kept in `sys.modules`."""
    module = sys.modules.get(MODULE_NAME)
    if module is None:
        with _load_lock:
            module = sys.modules.get(MODULE_NAME)
            if module is None:
                module = _load(remote_script("manifest.py"))
    return cast("ManifestModule", module)


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module


ManifestError: type[Exception] = manifest_module().ManifestError


def build_manifest(
    base: str | os.PathLike[str], outputs: Sequence[str], cache: CacheEntries | None = None
) -> Manifest:
    """`remote/manifest.py`'s `build_manifest` (see there)."""
    return manifest_module().build_manifest(base, _outputs(outputs), cache)


def diff_manifests(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """`remote/manifest.py`'s `diff_manifests` (see there)."""
    return manifest_module().diff_manifests(expected, actual)


def _outputs(outputs: Sequence[str]) -> list[str]:
    if isinstance(outputs, str):
        raise TypeError(f"outputs must be a list of paths, not a string ({outputs!r})")
    return list(outputs)


class _TrackedDict(dict[str, list[Any]]):
    """A dict that notes item assignment and deletion (the only ways
    `build_manifest` changes a cache), so an unchanged cache is not rewritten."""

    changed = False

    def __setitem__(self, key: str, value: list[Any]) -> None:
        self.changed = True
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.changed = True
        super().__delitem__(key)


def _valid_entry(value: object) -> bool:
    """[size, mtime_ns, ino, sha256 hex]"""
    return (
        isinstance(value, list)
        and len(value) == 4
        and all(type(v) is int for v in value[:3])
        and isinstance(value[3], str)
        and len(value[3]) == 64
    )


class HashCache:
    """The per-file hash cache of a step's files, kept in a JSON file: paths
    relative to the base folder, so staging and project folders can share it.

    A missing, unreadable or other-version file loads as an empty cache (a
    cache can always be rebuilt); `save` writes atomically with mode 0600,
    and only if something changed since `load`."""

    def __init__(self, path: Path, entries: Mapping[str, list[Any]] | None = None) -> None:
        self.path = path
        self.entries: CacheEntries = _TrackedDict(entries or {})
        self._on_disk = False

    @classmethod
    def load(cls, path: Path) -> HashCache:
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            return cls(path)
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return cls(path)
        raw = data.get("entries")
        if not isinstance(raw, dict):
            return cls(path)
        entries = {k: v for k, v in raw.items() if _valid_entry(v)}
        cache = cls(path, entries)
        cache._on_disk = len(entries) == len(raw)  # else rewrite it without the bad ones
        return cache

    @property
    def changed(self) -> bool:
        return not self._on_disk or cast(_TrackedDict, self.entries).changed

    def save(self) -> None:
        if not self.changed:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # compact: a cache of 20,000 files is 2 MB, 4x slower to indent
        write_json_atomic(self.path, {"version": CACHE_VERSION, "entries": dict(self.entries)}, indent=None)
        self._on_disk = True
        cast(_TrackedDict, self.entries).changed = False


def stamp_path(cache_file: Path) -> Path:
    return cache_file.with_name(cache_file.name + ".stamp")


def verify_outputs(
    base: str | os.PathLike[str],
    outputs: Sequence[str],
    expected_manifest: Mapping[str, Any],
    cache_file: Path,
    *,
    seed: Mapping[str, list[Any]] | None = None,
    digest_checked: bool = False,
) -> list[str]:
    """The differences between the outputs under `base` and
    `expected_manifest`; empty means verified. A tree refused by the
    manifest (a symlink escape, an output of the wrong kind) and an output
    that is missing, or was already missing when `expected_manifest` was
    taken, are differences too. Cached hashes are reused and updated.

    `seed`, if given, holds the files of a fetch's staging folder `base`
    hashed as they arrived (rel path -> [size, mtime_ns, ino, sha256,
    mode]): a file still at the same inode is described from its entry
    without a stat (`build_manifest`'s `staged`: nothing else writes there,
    and the copy never writes in place), and the entries replace the cache
    file's, which describe the files verified last time (a fresh copy's
    files are new inodes). Should the outputs not match, they are looked
    at again without that shortcut before any difference is reported.

    `digest_checked`: the caller has checked that the expected digest is
    that of the expected entries, so the entries are compared as they are,
    without encoding them again to digest them (a third of the time)."""
    mod = manifest_module()
    if seed is not None:
        cache = HashCache(cache_file, {rel: entry[:4] for rel, entry in seed.items()})
    else:
        cache = HashCache.load(cache_file)
    # The file system's clock, read before the walk: the files of a run just
    # made are cached when that clock has passed their mtime, so the first
    # no-op after the run does not hash them again (see build_manifest).
    clock = _clock_near(cache_file)
    try:
        actual = mod.build_manifest(
            base, _outputs(outputs), cache.entries, digest=not digest_checked, staged=seed, clock=clock
        )
        if seed and not _matches(actual, expected_manifest, digest_checked):
            # a second look, every file stat'ed: the shortcut never decides a refusal
            actual = mod.build_manifest(
                base, _outputs(outputs), cache.entries, digest=not digest_checked, clock=clock
            )
    except mod.ManifestError as exc:
        return [f"refused: {exc}"]
    finally:
        if seed is not None:
            _forget_young(cache.entries, mod.RACY_SECONDS, clock, base)
        cache.save()
    never = list(expected_manifest.get("missing", []))
    same = _matches(actual, expected_manifest, digest_checked)
    if same and not never and not actual["missing"]:
        return []
    problems = [f"output never produced: {out}" for out in never]
    problems += [f"missing output: {out}" for out in actual["missing"] if out not in never]
    problems += mod.diff_manifests(expected_manifest, actual)
    if not problems and not same and digest_checked:
        problems.append("the outputs' entries differ from the manifest's")
    elif not problems and not same:
        # equal entries but another digest: the record itself is damaged
        recorded = mod.entries_digest(list(expected_manifest["entries"]))
        problems.append(
            f"the expected manifest's digest {expected_manifest.get('digest')!r} does not match its "
            f"own entries ({recorded}): the record is damaged"
        )
    return problems


def _matches(actual: Manifest, expected: Mapping[str, Any], digest_checked: bool) -> bool:
    """The entries are those expected (compared directly when the expected
    digest is known to be its entries'; otherwise the digest covers them)."""
    if digest_checked:
        return bool(actual["entries"] == expected["entries"])
    return bool(actual["digest"] == expected.get("digest"))


def _clock_near(cache_file: Path) -> tuple[int, int] | None:
    """`fs_clock` beside the cache file (the state dir, where runs are
    staged too), or None where no file can be made there."""
    with contextlib.suppress(OSError):
        cache_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return manifest_module().fs_clock(str(cache_file))


def _forget_young(
    entries: CacheEntries,
    racy_seconds: int,
    clock: tuple[int, int] | None = None,
    base: str | os.PathLike[str] | None = None,
) -> None:
    """Keep only what build_manifest itself would have cached: a seed is
    trusted for the verification it was taken for, but a file modified less
    than `racy_seconds` ago is not remembered beyond it (see RACY_SECONDS),
    unless the file system's `clock`, read before the walk, had passed its
    mtime (and `base`, where the files are, is on that file system)."""
    limit = time.time_ns() - racy_seconds * 1_000_000_000
    if clock is not None and base is not None:
        try:
            same_fs = os.stat(base).st_dev == clock[1]  # noqa: PTH116 - a str or a Path, as given
        except OSError:
            same_fs = False
        if same_fs:
            limit = max(limit, clock[0])
    for rel in [rel for rel, entry in entries.items() if entry[1] >= limit]:
        del entries[rel]


def outputs_match(
    base: str | os.PathLike[str], outputs: Sequence[str], expected_digest: str, cache_file: Path
) -> bool:
    """True if every output exists and the manifest of the outputs has
    `expected_digest`. An untouched tree whose stamp was recorded costs one
    stat-only walk; a tree the manifest refuses does not match."""
    mod = manifest_module()
    outs = _outputs(outputs)
    stamp_file = stamp_path(cache_file)
    try:
        before, newest = mod.tree_stamp(base, outs)
    except mod.ManifestError:
        return False
    recorded = _read_stamp(stamp_file)
    if recorded == {"outputs": outs, "stamp": before, "digest": expected_digest}:
        return True
    cache = HashCache.load(cache_file)
    try:
        manifest = mod.build_manifest(base, outs, cache.entries)
    except mod.ManifestError:
        return False
    finally:
        cache.save()
    if manifest["missing"] or manifest["digest"] != expected_digest:
        return False
    # Record the stamp only if the tree held still while it was hashed and is
    # old enough that a later change cannot hide inside its timestamps.
    racy_limit = time.time_ns() - mod.RACY_SECONDS * 1_000_000_000
    if newest < racy_limit and mod.tree_stamp(base, outs)[0] == before:
        stamp_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_json_atomic(stamp_file, {"outputs": outs, "stamp": before, "digest": expected_digest})
    return True


def _read_stamp(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
