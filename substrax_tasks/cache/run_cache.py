"""The cache of verified runs: a step whose work was done before, here or
anywhere a shared store reaches, is restored instead of run (docs/cache.md).

An entry is keyed by what decides the step's outputs (`uptodate.key_parts`
without where it ran, unless `key_backend = true`) and holds the verified
output manifest and provenance; the files are objects named by their sha256
(_cache_store.py). A restore copies the objects into a staging folder and
verifies it against the entry's manifest with the same code that verifies a
fetched run; only then does the driver promote it, as it promotes a fetch.
The driver consults the cache only in its launch phase, which doit runs only
when the step must run: a no-op doit never reads it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks import __version__
from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.atomic import write_bytes_atomic, write_json_atomic
from substrax_tasks.backends.base import Fetched
from substrax_tasks.cache import packs as packing
from substrax_tasks.cache.packs import Pack
from substrax_tasks.cache.storage import (
    BUFFER,
    Damaged,
    Folder,
    ForeignCache,
    Shared,
    disk_use,
    drop_entry,
    entry_files,
    entry_path,
    is_part,
    log_path,
    materialize,
    object_path,
    refused_signature,
    write_entry,
    write_entry_pieces,
)
from substrax_tasks.console import emit
from substrax_tasks.constants import CACHE_ENV
from substrax_tasks.errors import ConfigError
from substrax_tasks.run.promote import safe_manifest
from substrax_tasks.step.spec import canonical_digest, safe_name
from substrax_tasks.uptodate import manifests as manifest_cache

if TYPE_CHECKING:
    from substrax_tasks.store.run_store import RunStore
    from substrax_tasks.uptodate.check import Step

KEY_VERSION = 1  # in every key: a new one would miss every entry kept before
# 2: an entry may list `packs` (packs.py). Entries of version 1 (one object
# per file) are still restored; a release that knows only 1 refuses a 2 as
# damaged rather than find its packed objects missing.
ENTRY_VERSION = 2
READABLE_VERSIONS = (1, 2)
WHERE_IT_RAN = ("backend", "settings")  # left out of the key unless key_backend = true
ORPHAN_SECONDS = 3600  # objects no entry names yet may belong to a store in progress
# A trim after a store goes below max_size, to this share of it, so the next
# (which reads every entry) comes only after that much more is stored.
TRIM_TO = 0.9
_UNREACHABLE: set[str] = set()  # stores that failed or were refused in this process: warned once
_CHECKED: set[str] = set()  # local folders found the user's own in this process
_READ_ONLY: set[str] = set()  # local folders this process said it cannot store in
_WARN_LOCK = threading.Lock()  # one warning per store, whatever the threads of `doit -n N -P thread`
_STATS_LOCK = threading.Lock()
_DIGEST = re.compile("[0-9a-f]{64}")  # an object's name: checked for each file of an entry
# What an entry keeps of the log of the run that made it: its end, where a
# run says how it finished. Bounded, so a chatty step costs the cache little.
LOG_KEPT = 64 << 10


@dataclass(frozen=True)
class Restored:
    fetched: Fetched
    key: str
    label: str
    provenance: dict[str, Any]
    shared: tuple[bytes, bytes | None] | None = None  # from the shared store: the entry and its signature
    packs: tuple[Pack, ...] = ()  # the entry's: kept as they are by `adopt`


@dataclass(frozen=True)
class CacheOptions:
    """`[tool.substrax.compute.cache]` as validated (settings.CacheSettings.options),
    kept with the project's resolved configuration: a restore imports no pydantic."""

    enabled: bool
    path: str | None
    max_bytes: int
    shared: str | None
    mode: str
    allowed_signers: str | None
    signing_key: str | None
    key_backend: bool

    def used(self) -> bool:
        """Whether this doit uses the cache: `enabled`, unless SUBSTRAX_CACHE=off."""
        value = os.environ.get(CACHE_ENV, "")
        if value not in {"", "off"}:
            raise ConfigError(f"{CACHE_ENV}={value!r} is not understood: set it to off to turn the "
                              "run cache off for this doit, or unset it to use the cache as configured")
        return self.enabled and value != "off"

    def folder(self, project: Path) -> Path:
        if self.path:
            return project / Path(self.path).expanduser()
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "substrax-tasks"


def cache_key(parts: dict[str, Any], key_backend: bool) -> str:
    """The key of a step's entry: its up-to-date key's parts, without where
    it ran unless asked (the same step on local, ssh or skypilot shares one)."""
    kept = {k: v for k, v in parts.items() if key_backend or k not in WHERE_IT_RAN}
    return canonical_digest({"cache_entry": KEY_VERSION, **kept})


class RunCache:
    """The project's view of the cache: its local folder and shared store."""

    def __init__(self, settings: CacheOptions, project: Path, store: RunStore) -> None:
        self.settings = settings
        self.local = Folder(settings.folder(project))
        self.shared = Shared(settings.shared, settings.mode == "readwrite") if settings.shared else None
        self.signers = _absolute(project, settings.allowed_signers)
        self.signing_key = _absolute(project, settings.signing_key)
        self.stats_file = store.run_cache_stats
        self.introduced = store.run_cache_introduced
        self.staging_root = store.restore_dir

    def _stores(self) -> list[Folder | Shared]:
        local = [self.local] if self._local_usable() else []
        shared = [self.shared] if self.shared is not None and self.shared.name not in _UNREACHABLE else []
        return [*local, *shared]

    def _local_usable(self) -> bool:
        """The local folder is used only if it is the user's own (checked
        once a process; its files are checked as they are read)."""
        name = self.local.name
        if name in _UNREACHABLE:
            return False
        if name not in _CHECKED:
            refused = self.local.refusal()
            if refused is not None:
                self._unreachable(self.local, refused)
                return False
            _CHECKED.add(name)
        return True

    def _local_writable(self) -> bool:
        """Whether a run may be kept in the local folder; said once if it cannot."""
        if not self._local_usable():
            return False
        if self.local.writable:
            return True
        with _WARN_LOCK:
            if self.local.name not in _READ_ONLY:
                _READ_ONLY.add(self.local.name)
                emit(f"note: the cache folder {self.local.name} cannot be written by you: steps are "
                     "restored from it, but no run is kept in it", err=True)  # fmt: skip
        return False

    def _unreachable(self, store: Folder | Shared, exc: BaseException) -> None:
        with _WARN_LOCK:
            if store.name in _UNREACHABLE:
                return
            _UNREACHABLE.add(store.name)
        if isinstance(exc, ForeignCache):  # its message names the folder, why and the fix
            emit(f"warning: {exc}", err=True)
            return
        emit(f"warning: the cache store {store.name} cannot be used ({type(exc).__name__}: {exc}); "
             "steps run without it", err=True)  # fmt: skip

    # ------------------------------------------------------------ restore
    def restore(self, step: Step, parts: dict[str, Any]) -> Restored | None:
        """The step's outputs from the first store holding a sound entry,
        staged and verified; None (the step runs) otherwise."""
        key = cache_key(parts, self.settings.key_backend)
        for store in self._stores():
            try:
                found = self._restore_from(store, step, key)
            except Exception as exc:  # noqa: BLE001 - any failure of a store: run the step instead
                self._unreachable(store, exc)
                continue
            if found is not None:
                self._count("hits")
                return found
        self._count("misses")
        return None

    def find(self, parts: dict[str, Any]) -> str | None:
        """Which entry a restore would try first (for `why`): named, or None."""
        key = cache_key(parts, self.settings.key_backend)
        for store in self._stores():
            try:
                found = self._entry(store, key)
                if isinstance(found, tuple):
                    prov = json.loads(found[0]).get("provenance") or {}
                    when = f"run {prov.get('run_id')}, {prov.get('time')}"
                    return f"cache entry {key[:16]} in {store.name} ({when})"
            except Exception:  # noqa: BLE001, S112 - unreachable or unreadable: not found
                continue
        return None

    def _entry(self, store: Folder | Shared, key: str) -> tuple[bytes, bytes | None] | str | None:
        """Entry `key` of `store` and its signature, if a restore may try it;
        else why not (found damaged before, or its signature refused); None
        if the store holds none."""
        data = store.read(entry_path(key))
        if data is None:
            return None
        label = f"cache entry {key[:16]} in {store.name}"
        if self._bad_marker(data).exists():
            return f"skipping {label}, found damaged before"
        if store is not self.shared:  # the local folder is ours: not checked for signatures
            return data, None
        signature = store.read(entry_path(key) + ".sig")
        why = refused_signature(data, signature, self.signers) if self.signers else None
        return f"refused {label}: {why}" if why else (data, signature)

    def _restore_from(self, store: Folder | Shared, step: Step, key: str) -> Restored | None:
        found = self._entry(store, key)
        if not isinstance(found, tuple):
            if found is not None:
                emit(f"{step.name}: {found}; the step runs")
            return None
        data, signature = found
        label = f"cache entry {key[:16]} in {store.name}"
        staging = self.staging_root / f"{safe_name(step.name)}-{secrets.token_hex(4)}"
        manifest: dict[str, Any] = {}
        packs: list[Pack] = []
        try:
            entry = _parsed(data, key)
            # Restored with no setuid, setgid or sticky bit and not
            # world-writable, whatever the entry says (promote.safe_mode).
            manifest = safe_manifest(entry["manifest"])
            packs = packing.parse(entry, _files(manifest))
            # The copies' digests, taken as they were written, fill the
            # outputs' hash cache: verifying them (here and at promotion)
            # then reads no byte again, only checks each copy's stat.
            hash_cache = manifest_cache.HashCache.load(step.files.outputs_cache)
            for rel, cache_entry in materialize(store, manifest, staging, key, packs).items():
                hash_cache.entries[rel] = cache_entry
            problems = manifest_cache.verify_outputs(staging, list(step.spec.outputs), manifest, hash_cache)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise Damaged(f"{problems[0]}{more}")
        except (Damaged, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
            self._condemn(store, key, data, staging, manifest, packs)
            shutil.rmtree(staging, ignore_errors=True)
            emit(f"{step.name}: {label} is damaged ({exc}); it is skipped from now on and the step runs")
            return None
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if store is self.local and self.local.writable:  # the newest used is the last trimmed
            os.utime(self.local.root / entry_path(key))
        prov = entry.get("provenance") or {}
        emit(f"{step.name}: restored from {label}: run {prov.get('run_id')} on {prov.get('backend')} "
             f"({prov.get('host')}, {prov.get('time')}); nothing launched")  # fmt: skip
        self._introduce()
        shared = (data, signature) if store is self.shared else None
        return Restored(Fetched(staging, manifest), key, label, prov, shared, tuple(packs))

    def _introduce(self) -> None:
        """The first time this project stores or restores an entry, one line:
        where the cache is, how big it may grow, how to turn it off. A marker
        in the project's state folder, made exclusively, says it once
        whatever the threads and doits."""
        try:
            self.introduced.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.close(os.open(self.introduced, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except OSError:  # said before (FileExistsError), or no state folder to remember it in
            return
        shared = f", and the shared store {self.shared.name}" if self.shared is not None else ""
        emit(f"note: verified runs are kept in the run cache {self.local.name}{shared}, shared by your "
             f"projects and trimmed to max_size {human_size(self.settings.max_bytes)} (oldest first); "
             "`substrax-compute cache status` shows it; to turn it off set enabled = false under "
             f"[tool.substrax.compute.cache], or {CACHE_ENV}=off for one doit (docs/cache.md)")

    def _bad_marker(self, data: bytes) -> Path:
        """Where an entry found damaged is marked, by its contents: skipped from then on."""
        return self.local.root / "bad" / hashlib.sha256(data).hexdigest()

    def _condemn(  # noqa: PLR0917
        self, store: Folder | Shared, key: str, data: bytes, staging: Path, manifest: dict[str, Any],
        packs: list[Pack],
    ) -> None:  # fmt: skip
        """Skip a damaged entry from now on; a store we may write also
        loses it and each object (or pack) whose copy was not what its name
        says, so the run that replaces it stores them again."""
        if self.local.writable:  # else it is found damaged again, each time
            marker = self._bad_marker(data)
            self.local.make_folder(marker.parent)
            write_bytes_atomic(marker, (key + "\n").encode())
        if not store.writable:
            return
        drop_entry(store, key)
        hash_file, buffer = remote_manifest.hash_file, memoryview(bytearray(BUFFER))
        in_pack = packing.packed(packs)
        for item in _files(manifest) if manifest else []:  # empty: the entry was not whole
            copy = f"{staging}/{item['path']}"
            try:
                bad = hash_file(copy, os.lstat(copy), buffer) != item["sha256"]
            except (OSError, manifest_cache.ManifestError):  # not copied, or not a plain file
                bad = True
            if bad:
                pack = in_pack.get(item["sha256"])
                store.remove(pack.rel if pack is not None else object_path(item["sha256"]))

    def _count(self, what: str) -> None:
        with _STATS_LOCK:
            stats = self.stats()
            stats[what] = stats.get(what, 0) + 1
            self.stats_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_json_atomic(self.stats_file, stats)

    def stats(self) -> dict[str, int]:
        try:
            data = json.loads(self.stats_file.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}

    # ------------------------------------------------------------ store
    def save(
        self, step: Step, key: str, manifest: dict[str, Any], provenance: dict[str, Any],
        log: bytes | None = None,
    ) -> None:  # fmt: skip
        """Keep the promoted outputs of a run as the entry `key`: locally,
        and in the shared store in readwrite mode, with its `log` (the tail
        cached_runs.log_tail keeps). Outputs changed since they were verified
        are not kept."""
        packs = self._keep_objects(step, manifest, packing.plan(_files(manifest))) \
            if self._local_writable() else None  # fmt: skip
        if packs is None:
            return
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        entry = {"version": ENTRY_VERSION, "key": key, "step": step.name, "outputs": list(step.spec.outputs),
                 "manifest": manifest, "pack_below": packing.PACK_BELOW,
                 "packs": [pack.as_json() for pack in packs],
                 "provenance": {**provenance, "time": stamp, "client": socket.gethostname(),
                                "tool_version": __version__}}  # fmt: skip
        if log is not None:
            self.local.write(log_path(key), log)
        else:  # an older run's log is not this one's
            self.local.remove(log_path(key))
        write_entry_pieces(self.local, key, _entry_json(entry), self.signing_key)
        self._introduce()
        if self.shared is not None and self.shared.writable and self.shared.name not in _UNREACHABLE:
            try:
                self.push(key)
            except Exception as exc:  # noqa: BLE001 - the outputs are home; the store can wait
                self._unreachable(self.shared, exc)
        self._fit(step)

    def adopt(self, step: Step, restored: Restored) -> None:
        """Keep a hit from the shared store in the local folder too, entry
        and signature as they came: the next restore here reads no network."""
        if restored.shared is None or not self._local_writable():
            return
        layout = [pack.members for pack in restored.packs]
        if self._keep_objects(step, restored.fetched.manifest, layout) == list(restored.packs):
            write_entry(self.local, restored.key, *restored.shared)
            self._fit(step)

    def _fit(self, step: Step) -> None:
        """After an entry was kept: nothing more while the objects fit in
        max_size (the account says so, whatever the folder holds); else a
        trim, below max_size (TRIM_TO), under the account's lock so one
        thread or process trims while the others wait and find it done.
        The entry is kept whatever happens here."""
        try:
            with self.local.account_lock():
                if self.local.move_account(0) > self.settings.max_bytes:
                    self._trim(int(self.settings.max_bytes * TRIM_TO), dry_run=False, cutoff=0.0)
        except OSError as exc:
            emit(f"{step.name}: could not trim the cache {self.local.name} ({exc}); "
                 "`substrax-compute gc` trims it", err=True)  # fmt: skip

    def _keep_objects(
        self, step: Step, manifest: dict[str, Any], layout: list[packing.Members]
    ) -> list[Pack] | None:
        """Copy the promoted outputs the local folder lacks in: the files
        `layout` packs as packs, the others as objects; the packs, or None
        (nothing kept) if the outputs changed since they were verified."""
        root, outputs, cache_file = step.root, list(step.spec.outputs), step.files.outputs_cache
        digest = str(manifest["digest"])
        if not manifest_cache.outputs_match(root, outputs, digest, cache_file):
            emit(f"{step.name}: outputs changed since they were verified; not kept in the cache")
            return None
        # The files are walked from the manifest (its packed records) as
        # they are copied: no dict or Path is held per file, only the packs'
        # members and the few files too large to pack. Paths as str: a Path
        # interns its parts for good (packs._read).
        base = f"{root}/"
        sources = ((e["sha256"], base + e["path"]) for e in _files(manifest))
        written = self.local.put_packs(layout, sources)
        added = [] if written is None else written[1]
        if written is not None:
            added += self.local.put(_unpacked_objects(root, manifest, layout))
        if written is None or not manifest_cache.outputs_match(root, outputs, digest, cache_file):
            self.local.remove_files(added)  # changed while copied
            emit(f"{step.name}: outputs changed while they were kept; not kept in the cache")
            return None
        return written[0]

    def push(self, key: str) -> int:
        """Upload the local entry `key` and the objects the shared store
        lacks (entry last); the number of objects sent."""
        if self.shared is None:
            raise Damaged("no shared store: set shared = \"s3://...\" in [tool.substrax.compute.cache]")
        data = self.local.read(entry_path(key))
        if data is None:
            raise Damaged(f"no local cache entry {key[:16]} in {self.local.name}")
        needed = self.shared.missing(sorted(_objects(_parsed(data, key))))
        self.shared.put([(self.local.root / rel, rel) for rel in needed])
        log = self.local.read(log_path(key))
        if log is not None:
            self.shared.write(log_path(key), log)
        write_entry(self.shared, key, data, self.local.read(entry_path(key) + ".sig"))
        return len(needed)

    def kept_log(self, key: str) -> tuple[bytes, dict[str, Any]] | str:
        """The log kept with entry `key` and the entry's provenance, from the
        first store that holds both; else why there is none."""
        why = f"cache entry {key[:16]} is in the cache no more (removed by a trim, `gc` or `cache forget`)"
        for store in self._stores():
            try:
                data = store.read(entry_path(key))
                if data is None:
                    continue
                provenance = _parsed(data, key).get("provenance") or {}
                log = store.read(log_path(key))
            except Exception as exc:  # noqa: BLE001 - unreachable or unreadable: try the next store
                why = f"cache entry {key[:16]} in {store.name} cannot be read ({type(exc).__name__}: {exc})"
                continue
            if log is not None:
                return log, provenance
            why = (f"cache entry {key[:16]} in {store.name} keeps no log (it was made by a release that "
                   "kept none)")  # fmt: skip
        return why

    def forget(self, key: str) -> list[str]:
        """Remove entry `key` from the local folder (and the shared store
        in readwrite mode); where it was removed."""
        gone = []
        for store in self._stores():
            if store.writable and store.read(entry_path(key)) is not None:
                drop_entry(store, key)
                gone.append(store.name)
        return gone

    # ------------------------------------------------------------ size
    def usage(self) -> tuple[list[tuple[float, str, set[str], int]], dict[str, tuple[int, float]]]:
        """The local entries (mtime, key, objects, the disk its own files
        take: its manifest, signature, stats and log; oldest first) and
        objects (disk use, mtime). An entry or object that goes while they
        are read (a part file renamed, another trim) is left out."""
        entries: list[tuple[float, str, set[str], int]] = []
        for path in (self.local.root / "entries").glob("*.json"):
            own = sum(map(self.local.disk_use_of, entry_files(path.stem)))
            try:
                data = path.read_bytes()
                used = path.stat().st_mtime
            except FileNotFoundError:
                continue
            except OSError:
                entries.append((0.0, path.stem, set(), own))  # unreadable: the first to go
                continue
            try:
                names = _objects(_parsed(data, path.stem))
            except Damaged:
                used, names = 0.0, set()
            entries.append((used, path.stem, names, own))
        objects = {}
        for rel in self.local.objects():
            try:
                st = (self.local.root / rel).stat()
            except FileNotFoundError:
                continue
            objects[rel] = (disk_use(st), st.st_mtime)
        return sorted(entries), objects

    def trim(self, dry_run: bool = False, older_than_days: float | None = None) -> list[str]:
        """Remove the local entries last used more than `older_than_days`
        ago, then the oldest until the objects fit in max_size, and objects
        no entry names; what was (or would be) removed. Reads every entry:
        `gc`'s, and a store's when the account says the folder is full."""
        cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else 0.0
        with self.local.account_lock():
            return self._trim(self.settings.max_bytes, dry_run=dry_run, cutoff=cutoff)

    def _trim(self, limit: int, *, dry_run: bool, cutoff: float) -> list[str]:
        """trim() to `limit` bytes, the account's lock held: no object comes
        or goes meanwhile, so the account is rewritten from what is seen."""
        entries, objects = self.usage()
        named = Counter(rel for _, _, names, _ in entries for rel in names)  # entries naming each object
        young = time.time() - ORPHAN_SECONDS
        dropped = [rel for rel, (_, mtime) in objects.items() if rel not in named and mtime < young]
        # Every object counts (young orphans too, which stay), and every
        # entry's own files: what the account counts.
        total = sum(size for rel, (size, _) in objects.items() if not is_part(rel)) \
            - sum(objects[rel][0] for rel in dropped if not is_part(rel)) \
            + sum(own for _, _, _, own in entries)  # fmt: skip
        removed = [f"object {rel} (named by no entry)" for rel in dropped]
        for used, key, names, own in entries:
            if total <= limit and used >= cutoff:
                break
            removed.append(f"entry {key[:16]}")
            total -= own
            if not dry_run:
                self.local.unlink_files(list(entry_files(key)))  # the account's lock is held
            for rel in names:
                named[rel] -= 1
                if named[rel] == 0 and rel in objects:
                    total -= objects[rel][0]
                    dropped.append(rel)
        if not dry_run:
            self.local.unlink_files(dropped)
            self.local.set_account(total)
        return removed


def human_size(n: float) -> str:
    """`n` bytes as B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _absolute(project: Path, path: str | None) -> str | None:
    return str(project / Path(path).expanduser()) if path else None


def _parsed(data: bytes, key: str) -> dict[str, Any]:
    """An entry's JSON, checked in shape; Damaged if it is not whole."""
    # Its manifest's entries are packed as they are read, a window of text
    # at a time: a dict per file of a large entry took ~1.3 KiB a file.
    try:
        entry = remote_manifest.load_manifest(data, within="manifest")
    except remote_manifest.ManifestFormatError as exc:
        raise Damaged(f"its manifest is not whole: {exc}") from None
    except ValueError as exc:
        raise Damaged(f"its JSON is not whole: {exc}") from None
    if entry.get("version") not in READABLE_VERSIONS or entry.get("key") != key:
        raise Damaged(f"it is not an entry of version {ENTRY_VERSION} for key {key[:16]}")
    manifest = entry.get("manifest")
    if not isinstance(manifest, dict) \
            or not isinstance(manifest.get("entries"), remote_manifest.PackedEntries) \
            or manifest.get("missing"):  # fmt: skip
        raise Damaged("its manifest is not whole")
    for item in manifest["entries"]:
        path = item.get("path") if isinstance(item, dict) else None
        if not isinstance(path, str) or not {"", ".", ".."}.isdisjoint(path.split("/")):  # "/x": "", "x"
            raise Damaged(f"its manifest lists {item!r}, not a plain relative path")
        digest = item.get("sha256")
        if item.get("type") == "file" and not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
            raise Damaged(f"its manifest lists file {path} without a sha256")
    try:
        packs = packing.parse(entry, _files(manifest))
    except ValueError as exc:
        raise Damaged(str(exc)) from None
    for pack in packs:
        if not _DIGEST.fullmatch(pack.sha256):
            raise Damaged(f"it lists a pack {pack.sha256[:80]!r} not named by its digest")
    return entry


def _objects(entry: dict[str, Any]) -> set[str]:
    """The objects a (parsed) entry names: its packs and its files not packed."""
    packs = packing.parse(entry, _files(entry["manifest"]))
    in_pack = packing.packed(packs)
    files = {object_path(e["sha256"]) for e in _files(entry["manifest"]) if e["sha256"] not in in_pack}
    return files | {pack.rel for pack in packs}


def _files(manifest: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The manifest's files, each decoded as it comes (its entries may be
    packed records: remote_manifest.PackedEntries)."""
    return (e for e in manifest["entries"] if e.get("type") == "file")


def _unpacked_objects(
    root: Path, manifest: dict[str, Any], layout: list[packing.Members]
) -> list[tuple[Path, str]]:
    """(source, object) of each distinct file of `manifest` that no pack of
    `layout` holds: the files kept as objects of their own."""
    skipped = {digest for members in layout for digest, _ in members}
    pairs = []
    for item in _files(manifest):
        digest = item["sha256"]
        if digest not in skipped:
            skipped.add(digest)
            pairs.append((root / item["path"], object_path(digest)))
    return pairs


def _entry_json(entry: dict[str, Any]) -> Iterator[bytes]:
    """`json.dumps(entry, sort_keys=True, separators=(",", ":"))`, byte for
    byte, in pieces: its manifest's entries, when packed, are written from
    their records a chunk at a time, never decoded all at once nor held whole
    as text (~1 KiB a file at 200,000 files)."""

    def dumps(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    manifest = entry["manifest"]
    entries = manifest["entries"]
    if not isinstance(entries, remote_manifest.PackedEntries):
        yield dumps(entry).encode()
        return
    marker = f"entries {secrets.token_hex(16)}"  # found nowhere else in the document
    before, after = dumps({**entry, "manifest": {**manifest, "entries": marker}}).split(dumps(marker))
    yield before.encode()
    for piece in entries.json_pieces():
        yield piece.encode()
    yield after.encode()
