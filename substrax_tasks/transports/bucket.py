"""The bucket transport: a run's outputs back from an object store.

A run's worker writes the step's outputs under
``<outputs_bucket>/<run_id>/outputs/<output path>`` and, last, their manifest
to ``<outputs_bucket>/<run_id>/manifest.json``; this side reads the manifest
(`read_manifest`) and copies the outputs into a staging folder (`download`).

Any fsspec file system works: s3fs for ``s3://`` (the `bucket` extra), gcsfs
for ``gs://``, adlfs for ``az://``, ... once its package is installed; a
missing one is named with the command that installs it. fsspec is imported
only when a transfer starts, never by importing this module.

s3fs reads the endpoint and credentials from the environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE``, ...); `endpoint_url` and `storage_options` (passed to the
file system's constructor, e.g. ``{"key": ..., "secret": ...,
"config_kwargs": {...}}``) override them. Every transport builds file systems
of its own (no fsspec instance cache), so a changed environment is honoured.

A download never leaves a half-written file at a final path: each object is
written to a hidden ``.<name>.<hex>.part`` beside its final path and renamed
over it once complete and of the listed size; a failed or interrupted copy
removes its part files (one orphaned by a SIGKILL is an extra file to the
verification of the fresh staging folder, so it is never promoted).

Object stores hold neither file modes, symlinks nor empty folders: a
downloaded file gets the default mode (`fetch_run` then sets the one the
manifest recorded), and a folder output with no object under it arrives as
an empty folder. Nothing is uploaded through it: the cluster mounts the
buckets it reads and writes (SkyPilot's MOUNT file mounts); a step's
checkpoints snapshots there are removed through it once its outputs are home.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from substrax_tasks.console import emit, marking, stderr
from substrax_tasks.errors import BackendError
from substrax_tasks.run.promote import safe_mode
from substrax_tasks.transports.base import (
    MAX_MANIFEST_BYTES,
    DiskFullHere,
    TransferStats,
    Transport,
    checked_manifest,
    progress,
)

MAX_WORKERS = 8  # parts copied at once: one request each, so small files do not go one by one
# A big object moves as ranged parts, several at once (as rclone does); the
# parts in flight are held in memory: MAX_WORKERS x PART at most.
PART = 16 << 20
INSTALL_BUCKET = "pip install 'substrax-tasks[bucket]'"
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class Copy:
    source: str  # a file system path
    dest: str
    size: int


class Changed(BackendError):
    """An object that is not of its listed size: changed, truncated or replaced."""


class BucketTransport(Transport):
    def __init__(
        self,
        endpoint_url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        show_progress: bool | None = None,
    ) -> None:
        self.endpoint_url = endpoint_url
        self.storage_options = dict(storage_options or {})
        self.show_progress = stderr().isatty() if show_progress is None else show_progress
        self._filesystems: dict[str, Any] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ file systems

    def filesystem(self, uri: str) -> tuple[Any, str]:
        """The fsspec file system for `uri` and the path within it (no
        protocol, no trailing "/"). One file system per protocol and transport."""
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise BackendError(
                f"the bucket transport needs fsspec to reach {uri}, and it is not installed: {INSTALL_BUCKET}"
            ) from None
        protocol, _ = fsspec.core.split_protocol(uri)
        if protocol is None:
            raise BackendError(f"{uri!r} is not a bucket URI; write it as s3://bucket/prefix (or gs://, ...)")
        try:
            cls = fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            raise BackendError(
                f"{uri} needs {_package_for(protocol)}, which is not installed: "
                f"pip install {_package_for(protocol)} ({exc})"
            ) from None
        except ValueError:
            raise BackendError(
                f"{uri}: unknown protocol {protocol!r}; expected one fsspec knows, "
                f"e.g. s3://, gs://, az://, file://"
            ) from None
        path = str(cls._strip_protocol(uri)).rstrip("/")
        with self._lock:
            fs = self._filesystems.get(protocol)
            if fs is None:
                options = dict(self.storage_options)
                if self.endpoint_url is not None:
                    options["endpoint_url"] = self.endpoint_url
                try:
                    fs = cls(skip_instance_cache=True, **options)
                except Exception as exc:
                    raise BackendError(
                        f"cannot set up {protocol}:// for {uri} with options {sorted(options)}: {exc}"
                    ) from exc
                self._filesystems[protocol] = fs
        fs.invalidate_cache()  # listings made before (by us or anyone) may be stale
        return fs, path

    def read_manifest(self, uri: str) -> dict[str, Any]:
        """The manifest at `uri` (``<outputs_bucket>/<run_id>/manifest.json``),
        checked whole: its digest must match its entries. Missing or damaged
        means the run did not finish writing its outputs: BackendError."""
        run_folder = uri.rstrip("/").rsplit("/", 1)[0]
        fs, path = self.filesystem(uri)
        try:
            data = fs.cat_file(path, start=0, end=MAX_MANIFEST_BYTES + 1)  # one byte more: too big
        except FileNotFoundError:
            raise BackendError(
                f"the run folder {run_folder} holds no {MANIFEST_NAME}: the run did not finish "
                f"writing its outputs (it failed, was stopped or lost, or the run id is wrong)"
            ) from None
        except Exception as exc:
            raise _failure("reading", uri, exc) from exc
        return checked_manifest(data, f"in the run folder {run_folder}")

    def folders(self, uri: str) -> list[str]:
        """The names of the folders (common prefixes) right under `uri`."""
        fs, path = self.filesystem(uri)
        try:
            listed = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise _failure("listing", uri, exc) from exc
        return sorted(PurePosixPath(str(e["name"])).name for e in listed if e.get("type") == "directory")

    def remove_tree(self, uri: str) -> None:
        """Every object under the prefix `uri` (nothing there: nothing to do)."""
        fs, path = self.filesystem(uri)
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise _failure("removing", uri, exc) from exc

    def fetch_run(self, run_folder: str, outputs: list[str], staging: Path) -> dict[str, Any]:
        """A run's outputs, as the worker left them in `run_folder`, into a
        fresh `staging`, with the modes its manifest recorded; the manifest."""
        manifest = self.read_manifest(f"{run_folder}/{MANIFEST_NAME}")
        shutil.rmtree(staging, ignore_errors=True)
        present = [o for o in outputs if o not in manifest["missing"]]
        if present:
            try:
                self.download(f"{run_folder}/outputs", present, staging)
            except DiskFullHere as exc:  # the phase says where, what is kept, the fix
                raise exc.full_disk() from None
        _apply_modes(staging, manifest)
        return manifest

    # ------------------------------------------------------------- transfers

    def download(self, remote_root: str, rel_paths: list[str], local_root: Path) -> TransferStats:
        """Copy ``remote_root/<rel>`` (an object, or every object under that
        prefix) to ``local_root/<rel>``. A path with nothing in the bucket
        is skipped (verification against the manifest names it); a folder
        output arrives, empty if nothing is under it."""
        started = time.monotonic()
        fs, root = self.filesystem(remote_root)
        folders: list[Path] = [local_root]
        copies: list[Copy] = []
        for rel in rel_paths:
            clean = _relative(rel, remote_root)
            where = f"{remote_root.rstrip('/')}/{clean}"
            # nothing there: skipped, as the contract says (the verification names it)
            for sub, name, size in _remote_tree(fs, f"{root}/{clean}", where, rel.endswith("/")):
                if name is None:
                    folders.append(local_root / clean / sub)
                else:
                    copies.append(Copy(name, str(local_root / clean / sub), size))
        try:
            for folder in folders:
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BackendError(f"cannot make the folders of the fetch in {local_root}: {exc}") from exc

        # every source is under `root`: shown as a URI under `remote_root`
        shown = remote_root.rstrip("/")
        return self.copy_all(fs, copies, lambda c: shown + c.source[len(root) :], started)[0]

    def copy_all(self, fs: Any, copies: list[Copy], name_of: Callable[[Copy], str],
                  started: float) -> tuple[TransferStats, dict[str, str]]:  # fmt: skip
        """Run the copies as parts, MAX_WORKERS at a time, with progress; the
        stats and each copy's sha256 (by destination), taken as its parts
        were written. On the first failure (or an interrupt) nothing more
        starts and the parts in flight are dropped; the first failure is raised."""
        stop = threading.Event()
        lock = threading.Lock()
        done = [0, 0]  # files, bytes: counted from many threads
        bar = progress("fetch") if self.show_progress and not marking() else None  # as rsync.py's
        if bar is None:
            emit(f"fetch: started, {len(copies)} files", err=True)
        task = bar.add_task("fetch", total=sum(c.size for c in copies), files="") if bar is not None else None
        objects = [_Object(copy) for copy in copies]

        def one(obj: _Object, start: int) -> None:
            if stop.is_set():
                return
            name, end = name_of(obj.copy), min(start + PART, obj.copy.size)
            try:
                whole = obj.add(start, _part(fs, obj.copy, start, end, name), name)
            except BackendError:
                raise
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # writing the part here
                    raise DiskFullHere(f"fetch of {name} failed: {exc}", exc.errno, obj.copy.dest) from exc
                raise _failure("fetch of", name, exc) from exc
            except Exception as exc:
                raise _failure("fetch of", name, exc) from exc
            with lock:
                done[0] += whole
                done[1] += end - start
                if bar is not None and task is not None:
                    bar.update(task, advance=end - start, files=f" {done[0]}/{len(copies)} files")

        parts = [(obj, start) for obj in objects for start in range(0, max(obj.copy.size, 1), PART)]
        with bar if bar is not None else contextlib.nullcontext():
            pool = ThreadPoolExecutor(max_workers=max(1, min(MAX_WORKERS, len(parts))))
            try:
                futures = [pool.submit(one, *part) for part in parts]
                wait(futures, return_when=FIRST_EXCEPTION)
                for future in futures:
                    failed = future.exception() if future.done() and not future.cancelled() else None
                    if failed is not None:
                        raise failed
            finally:
                stop.set()
                pool.shutdown(wait=True, cancel_futures=True)
                for obj in objects:
                    obj.drop()
        stats = TransferStats(files=done[0], bytes=done[1], seconds=time.monotonic() - started)
        if bar is None:
            emit(stats.summary("fetch"), err=True)
        return stats, {obj.copy.dest: obj.digest for obj in objects}


def _part(fs: Any, copy: Copy, start: int, end: int, name: str) -> bytes:
    """Bytes `start` to `end` of an object of listed size `copy.size`: the
    last part open-ended, so an object longer than listed shows as more
    bytes; an empty one without a range (a store refuses a range of none)."""
    if copy.size == 0:
        return bytes(fs.cat_file(copy.source))
    try:
        return bytes(fs.cat_file(copy.source, start=start, end=end if end < copy.size else None))
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # s3fs's "InvalidRange": nothing at `start`
            raise
        listed = f"{copy.size} bytes listed, none at {start}"
        raise Changed(f"{name} changed while it was fetched ({listed})") from exc


class _Object:
    """One object being copied as parts to a hidden part file beside its
    final path (same file system: the rename is atomic), renamed over it
    once every part is in and of its listed size, never before. Its sha256
    is taken in order as the parts arrive: each byte as it is written, or
    read back once the parts before it are in; no second pass over the copy."""

    def __init__(self, copy: Copy) -> None:
        self.copy = copy
        final = Path(copy.dest)
        self.part = final.with_name(f".{final.name[:200]}.{secrets.token_hex(4)}.part")  # within NAME_MAX
        self.fd: int | None = None
        self.sha = hashlib.sha256()
        self.hashed = 0
        self.waiting: dict[int, int] = {}  # parts written but not yet hashed: offset -> length
        self.digest = ""
        self.lock = threading.Lock()

    def add(self, start: int, data: bytes, name: str) -> bool:
        """Write one part; whether it completed the object (then in place)."""
        expected = min(PART, self.copy.size - start)
        if len(data) != expected:
            raise Changed(f"{name} changed while it was fetched ({expected} bytes listed at offset {start}, "
                          f"{len(data)} received)")  # fmt: skip
        with self.lock:
            if self.fd is None:
                self.part.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            view, at = memoryview(data), 0
            while at < len(data):  # short only when the disk is full: the next write says so
                at += os.pwrite(self.fd, view[at:], start + at)
            self.waiting[start] = len(data)
            while self.hashed in self.waiting:
                size = self.waiting.pop(self.hashed)
                self.sha.update(data if self.hashed == start else os.pread(self.fd, size, self.hashed))
                self.hashed += size
            if self.hashed < self.copy.size or self.digest:
                return False
            os.close(self.fd)
            self.fd = None
            self.part.replace(self.copy.dest)
            self.digest = self.sha.hexdigest()
            return True

    def drop(self) -> None:
        """After the copies: an unfinished one leaves no part file."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if not self.digest:
            self.part.unlink(missing_ok=True)


def _package_for(protocol: str) -> str:
    """The package that implements `protocol` for fsspec (s3 -> s3fs)."""
    from fsspec.registry import known_implementations  # type: ignore[import-untyped]

    known = known_implementations.get(protocol, {})
    return str(known.get("class", protocol)).split(".", 1)[0]


def _remote_tree(fs: Any, remote: str, where: str, folder: bool) -> list[tuple[str, str | None, int]]:
    """What is at the file system path `remote` (shown as `where`): (path
    below it, "" for itself; file system path, None for a folder; size).
    Nothing there is no entry; a declared `folder` ("out/") with no object
    under it is an empty folder: an object store cannot tell it from none."""
    try:
        info = fs.info(remote)
    except FileNotFoundError:
        return [("", None, 0)] if folder else []
    except Exception as exc:
        raise _failure("reading", where, exc) from exc
    if info.get("type") != "directory":
        return [("", remote, int(info.get("size") or 0))]
    try:
        listing: dict[str, dict[str, Any]] = fs.find(remote, withdirs=True, detail=True)
    except Exception as exc:
        raise _failure("listing", f"{where}/", exc) from exc
    tree: list[tuple[str, str | None, int]] = [("", None, 0)]
    for name, entry in sorted(listing.items()):
        sub = name[len(remote) + 1 :].rstrip("/") if name.startswith(remote + "/") else ""
        if sub:
            is_dir = entry.get("type") == "directory"
            tree.append((_relative(sub, f"{where}/"), None if is_dir else name, int(entry.get("size") or 0)))
    return tree


def _relative(rel: str, where: str) -> str:
    """`rel` without a trailing "/", refused unless it is a plain relative
    path (no "", ".", ".." components): a key like ``out/../../x`` must not
    land outside the local folder."""
    clean = rel.rstrip("/")
    parts = clean.split("/")
    if not clean or clean.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise BackendError(
            f"{rel!r} under {where} is not a plain relative path (no leading '/', '.', '..' or '//'): refused"
        )
    return str(PurePosixPath(*parts))


def _failure(action: str, uri: str, exc: BaseException) -> BackendError:
    if isinstance(exc, PermissionError):
        return BackendError(
            f"{action} {uri} was refused ({exc}): check the credentials (for s3://: AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and that they may use this bucket"
        )
    if isinstance(exc, FileNotFoundError):
        return BackendError(f"{action} {uri} failed: not found ({exc}); does the bucket exist?")
    if "Connect" in type(exc).__name__:  # botocore's EndpointConnectionError, aiohttp's, ...
        return BackendError(
            f"{action} {uri} failed: {exc}; is the endpoint right and reachable "
            "(for s3://: AWS_ENDPOINT_URL, or the transport's endpoint_url)?"
        )
    return BackendError(f"{action} {uri} failed: {type(exc).__name__}: {exc}")


def _apply_modes(root: Path, manifest: dict[str, Any]) -> None:
    """An object store keeps no file modes: the copies take the ones the
    worker recorded, made safe (promote.safe_mode: no setuid bit, ...), and
    verification then judges contents and sizes."""
    for entry in manifest.get("entries", []):
        path = root / str(entry.get("path"))
        if entry.get("type") in ("file", "dir") and isinstance(entry.get("mode"), int) and path.exists():
            path.chmod(safe_mode(entry["mode"]))
