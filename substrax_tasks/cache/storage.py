"""Where cache entries live: a folder on this machine, or a shared store
reached through fsspec, both laid out alike, plus the SSH signatures of
entries.

    entries/<key>.json       the entry: manifest, outputs, provenance
    entries/<key>.json.sig   its signature (`ssh-keygen -Y sign`), if signed
    entries/<key>.json.stats the stat of its objects when last hashed (local folder only)
    entries/<key>.log        the tail of the log of the run that made it (shown by `logs`, never restored)
    objects/<ab>/<sha256>    file contents, by digest: shared by every entry; the
                             small files of an entry are packed together (packs.py)
    size.json                the local folder's account: the disk its objects and entries take
    size.lock                held while objects come and go (flock: threads and processes)

An entry is written last, after every object it names: a store never holds
an entry whose objects were not all written (an interrupted write leaves
objects no entry names, which a trim removes).

The local folder is the user's own: it, its `entries` and `objects`
folders and every file read from it must belong to the user and be
writable by no one else, or the folder is not used (`ForeignCache`):
another local user able to rewrite an entry could choose what is restored
into the project. A folder the user cannot write (a read-only mount) is
still restored from; nothing is stored in it.

The account is kept as each object is added or removed, under its lock, so
keeping an entry costs what the entry costs, not a walk of the whole folder
(shared by every project of the user); it is recounted only when missing or
damaged, and rewritten from what a full trim (`gc`) saw.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import secrets
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks._remote import manifest as remote_manifest
from substrax_tasks.atomic import write_bytes_atomic, write_pieces_atomic
from substrax_tasks.cache.packs import Members, Pack, packed, write_pack
from substrax_tasks.errors import BackendError
from substrax_tasks.uptodate.manifests import CacheEntries, HashCache

if TYPE_CHECKING:
    from filelock import FileLock

ACCOUNT = "size.json"
ACCOUNT_LOCK = "size.lock"
# 2: the account counts disk use (st_blocks), not st_size; an account of
# version 1 is counted again. 3: it counts the entries' files too (an
# entry's manifest of 50,000 files takes 7.8 MB where its packed objects
# take 0.5), so an account of version 2 is counted again.
ACCOUNT_VERSION = 3
NAMESPACE = "substrax-cache"  # of the SSH signatures: a key's other signatures do not count
UPLOADS = 8  # objects sent to a shared store at once: one request each
BUFFER = 1 << 20  # one reused buffer per restore: no allocation per file
RACY_NS = int(remote_manifest.RACY_SECONDS * 1e9)
TRUSTED_SIZE = 1 << 20  # objects whose stat is recorded (see copy_object)
FICLONE = 0x40049409  # linux/fs.h: make dst share src's blocks
# An upload sends 50 MiB parts 4 at once: s3fs's 10 would hold 500 MB in
# memory. (Downloads go as the bucket transport's parts: bucket.PART.)
S3_PARTS = {"max_concurrency": 4}

# What a restore made of each file: its sha256 and stat, as the outputs'
# hash cache keys it ([size, mtime_ns, ctime_ns, inode, device, sha256]).
Made = dict[str, bytes]
# Objects to restore: (object, destination, mode, size) each.
Wanted = list[tuple[str, str, int, int]]


def object_path(sha256: str) -> str:
    return f"objects/{sha256[:2]}/{sha256}"


def entry_path(key: str) -> str:
    return f"entries/{key}.json"


def log_path(key: str) -> str:
    """The tail of the log of the run an entry was made by."""
    return f"entries/{key}.log"


def stats_path(key: str) -> str:
    """The local folder's hash cache of an entry's objects (see copy_object)."""
    return f"entries/{key}.json.stats"


def copy_fd(src: int, dst: int, size: int) -> None:
    """Copy `size` bytes from `src`'s offset to the empty `dst`: a reflink
    where the file system shares blocks (btrfs, XFS), else copy_file_range
    (in the kernel), else read and write from where it stopped."""
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return
    except OSError:  # another file system, or none that shares blocks
        pass
    left = size
    try:
        while left > 0 and (sent := os.copy_file_range(src, dst, left)):
            left -= sent
    except OSError:
        while chunk := os.read(src, BUFFER):
            os.write(dst, chunk)


def is_part(rel: str) -> bool:
    """A part file of an object being written (Folder.put), not an object."""
    return rel.rsplit("/", 1)[-1].startswith(".")


def disk_use(st: os.stat_result) -> int:
    """The bytes a file takes on disk: its blocks, not its length. A 10-byte
    file takes a whole block (4 KiB on ext4 and tmpfs), and max_size is about
    the disk the cache takes."""
    return st.st_blocks * 512


stat_key = remote_manifest.stat_key  # a file's key in a hash cache (manifest_cache.py): any write changes it


def entry_files(key: str) -> tuple[str, ...]:
    """Every file an entry has beside its objects: what goes with it."""
    return entry_path(key), entry_path(key) + ".sig", stats_path(key), log_path(key)


def drop_entry(store: Folder | Shared, key: str) -> None:
    if isinstance(store, Folder):
        with store.account_lock():
            store.move_account(-store.unlink_files(list(entry_files(key))))
        return
    for rel in entry_files(key):
        store.remove(rel)


def write_entry(store: Folder | Shared, key: str, data: bytes, signature: bytes | None) -> None:
    """The entry after its objects, and its signature (or none) before it."""
    if signature is not None:
        store.write(entry_path(key) + ".sig", signature)
    else:
        store.remove(entry_path(key) + ".sig")
    store.write(entry_path(key), data)  # last: its objects are all in


def write_entry_pieces(folder: Folder, key: str, pieces: Iterable[bytes], signing_key: str | None) -> None:
    """write_entry for a local entry given a piece at a time (a large
    manifest's entries are never held whole, as text or as dicts): written
    beside its place, signed from that file, its signature (or none) put
    first, then renamed into place."""
    path = folder.root / entry_path(key)
    folder.make_folder(path.parent)

    signature = path.with_name(path.name + ".sig")

    def signed(written: Path) -> None:
        if signing_key is not None:
            write_bytes_atomic(signature, sign(written, signing_key))
        else:
            signature.unlink(missing_ok=True)

    with folder.counted(entry_path(key), entry_path(key) + ".sig"):  # the two, counted as one write
        write_pieces_atomic(path, pieces, before_rename=signed)


class Damaged(Exception):
    """An entry that must not be promoted; the message says why."""


class ForeignCache(Exception):
    """The local cache folder, or a file in it, that another user could
    have written: the folder is not used; the message says why and the fix."""


def _not_ours(path: str | Path, st: os.stat_result) -> str | None:
    """Why `path` (its stat `st`) may have been written by another user, or None."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid}, not to you (uid {uid})"
    if st.st_mode & 0o022:
        who = {0o022: "group and others", 0o020: "group", 0o002: "others"}[st.st_mode & 0o022]
        return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def foreign(folder: str | Path, why: str) -> ForeignCache:
    """The refusal of the cache `folder` because of `why` (`_not_ours`), with its fix."""
    return ForeignCache(
        f"the cache folder {folder} is not used: {why}, so another user could have rewritten the "
        f"outputs it restores; make it yours alone (chown -R {os.geteuid()} {folder} && chmod -R go-w "
        f"{folder}) or set `path` in [tool.substrax.compute.cache] to another folder; steps run "
        "without it"
    )


def materialize(
    store: Folder | Shared, manifest: dict[str, Any], staging: Path, key: str, packs: list[Pack]
) -> CacheEntries:
    """The manifest's tree under `staging`, contents from the objects and
    `packs` of entry `key`, each hashed as it is copied unless the store
    vouches for it (Folder.get); the copies' hash cache entries, by path.
    Symlinks come last, so no write can go through one, and the folders'
    modes after the files, so none blocks a write."""
    staging.mkdir(parents=True, mode=0o700)
    base = f"{staging}/"
    wanted, links, folders, made = [], [], [], {str(staging)}
    in_pack = packed(packs)
    unpacking: dict[str, dict[str, list[tuple[str, int]]]] = {}  # pack -> member -> (destination, mode)
    for item in manifest["entries"]:
        path, kind = base + item["path"], item.get("type")
        folder = path if kind == "dir" else os.path.dirname(path)  # noqa: PTH120
        if folder not in made:  # made once, not once per file
            os.makedirs(folder, exist_ok=True)  # noqa: PTH103
            made.add(folder)
        if kind == "dir":
            folders.append((path, item.get("mode")))
        elif kind == "file":
            mode = item.get("mode")
            mode = mode if isinstance(mode, int) else 0o644
            pack = in_pack.get(item["sha256"])
            if pack is not None:
                unpacking.setdefault(pack.sha256, {}).setdefault(item["sha256"], []).append((path, mode))
            else:
                wanted.append((object_path(item["sha256"]), path, mode, int(item.get("size") or 0)))
        elif kind == "symlink" and isinstance(item.get("target"), str):
            links.append((item["target"], path))
        else:
            raise Damaged(f"its manifest lists {item['path']} of type {kind!r}")
    copies = store.get(wanted, key)
    copies.update(_unpack_all(store, packs, unpacking, staging))
    for target, path in links:
        os.symlink(target, path)  # noqa: PTH211
    for path, mode in reversed(folders):  # the deepest first
        if isinstance(mode, int):
            os.chmod(path, mode)  # noqa: PTH101
    return {dest[len(base):]: entry for dest, entry in copies.items()}


def _unpack_all(
    store: Folder | Shared, packs: list[Pack], unpacking: dict[str, dict[str, list[tuple[str, int]]]],
    staging: Path,
) -> Made:  # fmt: skip
    """The packed files under `staging` (`unpacking`: by pack, by digest,
    destinations and modes)."""
    scratch = staging.with_name(f".{staging.name}.packs")  # a shared store's packs, while unpacked
    made: Made = {}
    try:
        for pack in packs:
            if pack.sha256 in unpacking:
                made.update(store.unpack(pack, unpacking[pack.sha256], scratch))
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return made


def copy_object(  # noqa: PLR0917
    root: str, rel: str, dest: str, mode: int, buffer: bytearray, known: CacheEntries | None
) -> bytes:
    """Copy the object `root + rel` to the new file `dest` with `mode`; the hash
    cache key of `dest`. An object whose stat still matches its key in
    `known` is copied as it is (a reflink where the file system can): its
    name is its digest, and any write since it was hashed changed its stat.
    Any other is hashed as it is copied (each byte read once), and kept in
    `known` when it is what its name says and older than the racy window.
    Small objects (`known` None) cost less to hash than to look up."""
    digest = rel.rsplit("/", 1)[-1]
    src = os.open(root + rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(src)
        why = _not_ours(root + rel, st)
        if why is not None:
            raise foreign(root.rstrip("/"), why)
        key = stat_key(st) if known is not None else b""
        dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode & 0o777)
        try:
            if known is not None and remote_manifest.cached_digest(known.get(rel), key) == digest:
                copy_fd(src, dst, st.st_size)
                made = _made(dst, mode, digest)
                if stat_key(os.fstat(src)) == key and remote_manifest.record_values(made)[0][0] == st.st_size:
                    return made
                os.lseek(src, 0, os.SEEK_SET)  # it changed under the copy: copy again, hashing
                os.ftruncate(dst, 0)
                os.lseek(dst, 0, os.SEEK_SET)
            found = _copy_hashed(src, dst, buffer)
            if known is not None and found == digest and st.st_ctime_ns < time.time_ns() - RACY_NS \
                    and stat_key(os.fstat(src)) == key:  # fmt: skip
                # the racy rule of manifest_cache: never a young file
                known[rel] = remote_manifest.cache_record(key, digest)
            return _made(dst, mode, found)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_hashed(src: int, dst: int, buffer: bytearray) -> str:
    """The sha256 of what is left to read of `src`, written to `dst` as it is read."""
    sha = hashlib.sha256()
    view = memoryview(buffer)
    while size := os.readv(src, [buffer]):
        sha.update(view[:size])
        done = 0
        while done < size:
            done += os.write(dst, view[done:size])
        if size < len(buffer):  # a regular file reads short only at its end: no read to see it
            break
    return sha.hexdigest()


def unpack_fd(fd: int, pack: Pack, wanted: dict[str, list[tuple[str, int]]]) -> Made:
    """Write the members of `pack` (open as `fd`) that `wanted` names (by
    digest: destinations and modes) to new files, each hashed as it is
    read; their hash cache keys, by destination, with the digest found: the
    verification against the manifest refuses a member that is not what
    its name says."""
    size = os.fstat(fd).st_size
    if size != pack.size:
        raise Damaged(f"its pack {pack.rel} holds {size} bytes, not the {pack.size} it lists")
    made, offset = {}, 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for digest, length in pack.members:
        if digest in wanted:
            data = memoryview(os.pread(fd, length, offset))
            found = hashlib.sha256(data).hexdigest()
            for dest, mode in wanted[digest]:
                out = os.open(dest, flags, mode & 0o777)
                try:
                    done = 0
                    while done < len(data):
                        done += os.write(out, data[done:])
                    made[dest] = _made(out, mode, found)
                finally:
                    os.close(out)
        offset += length
    return made


def made_of(path: str, mode: int, digest: str) -> bytes:
    """The hash cache key of a file a download just wrote and hashed, with
    `mode` (an object store keeps none)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return _made(fd, mode, digest)
    finally:
        os.close(fd)


def _made(fd: int, mode: int, digest: str) -> bytes:
    st = os.fstat(fd)
    if st.st_mode & 0o7777 != mode:  # the umask took bits off, or a download's file
        os.fchmod(fd, mode)  # last: the stat below is the file's final one
        st = os.fstat(fd)
    return remote_manifest.cache_record(stat_key(st), digest)


class Folder:
    """A store on this machine (the local cache, mode 0700): the user's own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name = str(root)

    @property
    def writable(self) -> bool:
        """Whether this user may write the folder (or make it, if absent)."""
        existing = next((p for p in (self.root, *self.root.parents) if p.exists()), Path("/"))
        return os.access(existing, os.W_OK | os.X_OK)

    def refusal(self) -> ForeignCache | None:
        """Why the folder is not used, if another user could have written
        it or its `entries` or `objects` folder (see the module's docstring)."""
        for path in (self.root, self.root / "entries", self.root / "objects"):
            try:
                st = path.stat() if path == self.root else path.lstat()  # the root may be a link of yours
            except FileNotFoundError:
                continue
            why = _not_ours(path, st)
            if why is not None:
                return foreign(self.root, why)
        return None

    def read(self, rel: str) -> bytes | None:
        try:
            fd = os.open(self.root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        with open(fd, "rb") as f:  # noqa: PTH123 - a descriptor, opened without following links
            why = _not_ours(self.root / rel, os.fstat(fd))
            if why is not None:
                raise foreign(self.root, why)
            return f.read()

    def make_folder(self, folder: Path) -> None:
        """`folder` (the root or one under it) and the folders between, each
        made with mode 0700 (never the umask's: a group-writable one would be
        refused)."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        path = self.root
        for part in ("", *folder.relative_to(self.root).parts):
            path = path / part
            with contextlib.suppress(FileExistsError):
                path.mkdir(mode=0o700)

    def write(self, rel: str, data: bytes) -> None:
        path = self.root / rel
        self.make_folder(path.parent)
        with self.counted(rel):
            write_bytes_atomic(path, data)

    @contextlib.contextmanager
    def counted(self, *rels: str) -> Iterator[None]:
        """Write the files `rels` (an entry's: objects are counted as they
        are linked in) inside: the account moves by the disk they take now
        less what they took before. Under the account's lock, so that a trim
        never misses them; no other counted write may be nested in one."""
        with self.account_lock():
            before = sum(map(self.disk_use_of, rels))
            try:
                yield
            finally:
                self.move_account(sum(map(self.disk_use_of, rels)) - before)

    def disk_use_of(self, rel: str) -> int:
        """The disk the file `rel` takes (0 if there is none)."""
        try:
            return disk_use((self.root / rel).lstat())
        except FileNotFoundError:
            return 0

    def entry_files(self) -> set[str]:
        """Every file in `entries/` (part files of those being written too)."""
        try:
            return {f"entries/{path.name}" for path in (self.root / "entries").iterdir()}
        except FileNotFoundError:
            return set()

    def objects(self) -> set[str]:
        """Every object, and the part files of objects being written (a trim
        removes those left by a writer that died)."""
        found: set[str] = set()
        for folder, _, names in os.walk(self.root / "objects"):  # nothing if it is missing
            prefix = f"objects/{Path(folder).name}/"
            found.update(prefix + name for name in names)
        return found

    # ------------------------------------------------------------ account
    def account_lock(self) -> FileLock:
        """The account's lock, to hold while objects are added or removed.
        A new lock each time: an flock excludes the threads of a process as
        it excludes processes (a shared one would let a second thread in)."""
        from filelock import FileLock

        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        # 0600 whatever the umask, as every file of the folder (see ForeignCache)
        return FileLock(str(self.root / ACCOUNT_LOCK), mode=0o600, thread_local=False, is_singleton=False)

    def size(self) -> int:
        """The disk the objects and entries take in bytes, from the account."""
        with self.account_lock():
            return self.move_account(0)

    def move_account(self, delta: int) -> int:
        """The account moved by `delta` bytes (the account's lock held); a
        recount if it is missing or damaged (which finds the change made)."""
        try:
            data = json.loads((self.root / ACCOUNT).read_bytes())
            total = data["bytes"] if data.get("version") == ACCOUNT_VERSION else None
        except (OSError, ValueError, AttributeError, KeyError):
            total = None
        if isinstance(total, int) and total + delta >= 0:
            if not delta:
                return total
            total += delta
        else:
            total = self.recount()
        self.set_account(total)
        return total

    def set_account(self, total: int) -> None:
        """Write the account (its lock held)."""
        data = json.dumps({"version": ACCOUNT_VERSION, "bytes": total}).encode()
        write_bytes_atomic(self.root / ACCOUNT, data)

    def recount(self) -> int:
        """The disk the objects and entries take, from a stat of each (part
        files left out)."""
        total = 0
        for rel in self.objects() | self.entry_files():
            if not is_part(rel):
                with contextlib.suppress(FileNotFoundError):
                    total += disk_use((self.root / rel).stat())
        return total

    def unlink_files(self, rels: list[str]) -> int:
        """Remove objects or an entry's files (the account's lock held); the
        disk they took."""
        freed = 0
        for rel in rels:
            path = self.root / rel
            try:
                size = disk_use(path.lstat())
                path.unlink()
            except FileNotFoundError:
                continue
            if not is_part(rel):  # a part file was never counted
                freed += size
        return freed

    def get(self, wanted: Wanted, key: str) -> Made:
        """Copy entry `key`'s objects to new files; by destination. Objects
        here are ours: their stat, kept when they were last hashed, spares
        reading them again (copy_object)."""
        buffer, root, made = bytearray(BUFFER), f"{self.root}/", {}
        stats = self.root / stats_path(key)
        with contextlib.suppress(FileNotFoundError):  # it vouches for objects: ours alone, or none
            why = _not_ours(stats, stats.lstat())
            if why is not None:
                raise foreign(self.root, why)
        known = HashCache.load(stats)
        for rel, dest, mode, size in wanted:
            try:
                made[dest] = copy_object(root, rel, dest, mode, buffer,
                                         known.entries if size >= TRUSTED_SIZE else None)  # fmt: skip
            except FileNotFoundError as exc:
                if exc.filename == root + rel:
                    raise FileNotFoundError(f"object {rel} is missing") from None
                raise
        if known.entries and self.writable:  # a read-only folder is still restored from
            with self.counted(stats_path(key)):
                known.save()
        return made

    def put(self, pairs: list[tuple[Path, str]]) -> list[str]:
        """Copy local files in as objects, each whole or not at all (never a
        hard link, which an in-place edit of an output would carry in); the
        objects this call added. Each is copied to a part file, then linked
        to its name under the account's lock: an object another thread or
        process added meanwhile stays as it is, and is counted once."""
        parts: list[tuple[Path, str, int]] = []
        try:
            for source, rel in pairs:
                final = self.root / rel
                if final.exists():
                    continue
                self.make_folder(final.parent)
                part = final.with_name(f".{final.name}.{secrets.token_hex(4)}.part")
                parts.append((part, rel, 0))
                # mode 0600 whatever the umask: a group-writable object is refused
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                with source.open("rb") as src, open(os.open(part, flags, 0o600), "wb") as dst:  # noqa: PTH123
                    copy_fd(src.fileno(), dst.fileno(), os.fstat(src.fileno()).st_size)
                    parts[-1] = (part, rel, disk_use(os.fstat(dst.fileno())))
            added, grown = [], 0
            with self.account_lock():
                for part, rel, size in parts:
                    try:
                        os.link(part, self.root / rel)
                    except FileExistsError:
                        continue
                    added.append(rel)
                    grown += size
                self.move_account(grown)
            return added
        finally:
            for part, _, _ in parts:
                part.unlink(missing_ok=True)

    def unpack(self, pack: Pack, wanted: dict[str, list[tuple[str, int]]], scratch: Path) -> Made:
        """Write members of `pack` out (unpack_fd), read where it lies."""
        try:
            fd = os.open(self.root / pack.rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FileNotFoundError(f"pack {pack.rel} is missing") from None
        try:
            why = _not_ours(self.root / pack.rel, os.fstat(fd))
            if why is not None:
                raise foreign(self.root, why)
            return unpack_fd(fd, pack, wanted)
        finally:
            os.close(fd)

    def put_packs(
        self, layout: list[Members], sources: Iterator[tuple[str, str]]
    ) -> tuple[list[Pack], list[str]] | None:
        """Pack the files `sources` names (by digest, in the manifest's
        order: write_pack) as `layout` says; the
        packs and the objects this call added, each linked to its name
        under the account's lock as Folder.put's are. None (nothing added)
        if a source is not what its digest says any more."""
        objects = self.root / "objects"
        self.make_folder(objects)
        parts: list[tuple[Path, int, Pack]] = []
        try:
            for members in layout:
                made = write_pack(objects, members, sources)
                if made is None:
                    return None
                part, digest, used = made
                parts.append((part, used, Pack(digest, members.total(), members)))
            added, grown = [], 0
            with self.account_lock():
                for part, used, pack in parts:
                    final = self.root / pack.rel
                    self.make_folder(final.parent)
                    try:
                        os.link(part, final)
                    except FileExistsError:
                        continue
                    added.append(pack.rel)
                    grown += used
                self.move_account(grown)
            return [pack for _, _, pack in parts], added
        finally:
            for part, _, _ in parts:
                part.unlink(missing_ok=True)

    def remove(self, rel: str) -> None:
        self.remove_files([rel])

    def remove_files(self, rels: list[str]) -> None:
        with self.account_lock():
            self.move_account(-self.unlink_files(rels))


class Shared:
    """A store any fsspec file system reaches (s3://, file://, ...); the
    endpoint and credentials as the bucket transport takes them."""

    def __init__(self, url: str, writable: bool) -> None:
        from substrax_tasks.transports.bucket import BucketTransport

        self.name = url.rstrip("/")
        self.writable = writable
        s3 = url.startswith(("s3://", "s3a://"))
        self.transport = BucketTransport(storage_options=S3_PARTS if s3 else None, show_progress=False)

    @functools.cached_property
    def _fs_root(self) -> tuple[Any, str]:
        """The file system and the store's path in it, set up on first use
        (importing s3fs costs most of a second)."""
        return self.transport.filesystem(self.name)

    @property
    def fs(self) -> Any:
        return self._fs_root[0]

    def _path(self, rel: str) -> str:
        return f"{self._fs_root[1]}/{rel}"

    def read(self, rel: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self._path(rel)))
        except FileNotFoundError:
            return None

    def _parents(self, rels: list[str]) -> None:
        """Folders for new objects (file://, unlike object stores, needs them)."""
        for parent in sorted({self._path(rel).rsplit("/", 1)[0] for rel in rels}):
            self.fs.makedirs(parent, exist_ok=True)

    def write(self, rel: str, data: bytes) -> None:
        self._parents([rel])
        self.fs.pipe_file(self._path(rel), data)

    def missing(self, rels: list[str]) -> list[str]:
        """Those of the objects `rels` the store lacks: one request each, so
        a push costs what its entry holds, not a listing of the store."""
        with ThreadPoolExecutor(max_workers=UPLOADS) as pool:
            there = list(pool.map(lambda rel: bool(self.fs.exists(self._path(rel))), rels))
        return [rel for rel, found in zip(rels, there, strict=True) if not found]

    def get(self, wanted: Wanted, key: str) -> Made:
        """Download objects (the bucket transport's parallel, whole-or-nothing
        copies, each hashed as it arrives); by destination."""
        from substrax_tasks.transports.bucket import Changed, Copy

        copies = [Copy(self._path(rel), dest, size) for rel, dest, _, size in wanted]
        try:
            _, digests = self.transport.copy_all(self.fs, copies, lambda c: c.source, time.monotonic())
        except BackendError as exc:
            # a missing object, or one not of its listed size: a damaged entry
            if isinstance(exc, Changed) or isinstance(exc.__cause__, FileNotFoundError):
                raise FileNotFoundError(str(exc)) from None
            raise
        return {dest: made_of(dest, mode, digests[dest]) for _, dest, mode, _ in wanted}

    def unpack(self, pack: Pack, wanted: dict[str, list[tuple[str, int]]], scratch: Path) -> Made:
        """Download `pack` to `scratch` (hashed as it arrives: it must be what
        its name says) and write members of it out (unpack_fd)."""
        scratch.mkdir(mode=0o700, exist_ok=True)
        local = str(scratch / pack.sha256)
        try:
            record = self.get([(pack.rel, local, 0o600, pack.size)], "")[local]
            if remote_manifest.record_values(record)[1] != pack.sha256:
                raise Damaged(f"its pack {pack.rel} is not what its name says")
            fd = os.open(local, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                return unpack_fd(fd, pack, wanted)
            finally:
                os.close(fd)
        finally:
            Path(local).unlink(missing_ok=True)

    def put(self, pairs: list[tuple[Path, str]]) -> None:
        self._parents([rel for _, rel in pairs])
        with ThreadPoolExecutor(max_workers=UPLOADS) as pool:
            list(pool.map(lambda pair: self.fs.put_file(str(pair[0]), self._path(pair[1])), pairs))

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(rel))


# ------------------------------------------------------------------ signatures


def _keygen(data: bytes | Path, *args: str) -> tuple[int, bytes, str]:
    """`ssh-keygen -Y ARGS` given `data` (or the file `data`) on its stdin:
    exit code, stdout, all it said."""
    argv = ["ssh-keygen", "-Y", *args]
    if isinstance(data, Path):  # a large entry is read by ssh-keygen, never held here
        with data.open("rb") as stdin:
            done = subprocess.run(argv, stdin=stdin, capture_output=True, check=False)
    else:
        done = subprocess.run(argv, input=data, capture_output=True, check=False)
    return done.returncode, done.stdout, (done.stdout + done.stderr).decode(errors="replace").strip()


def sign(data: bytes | Path, key_file: str) -> bytes:
    """The SSH signature of `data` (bytes, or a file's) by `key_file` (the private key)."""
    code, signature, said = _keygen(data, "sign", "-q", "-f", key_file, "-n", NAMESPACE)
    if code != 0:
        raise BackendError(f"cannot sign cache entries with signing_key {key_file}: {said}")
    return signature


def refused_signature(data: bytes, signature: bytes | None, allowed_signers: str) -> str | None:
    """None if `signature` is a valid signature of `data` by a key listed in
    `allowed_signers`; else why not, naming the signer."""
    if signature is None:
        return "it is not signed"
    with tempfile.TemporaryDirectory(prefix="substrax-verify-") as folder:
        sig = Path(folder) / "entry.sig"
        sig.write_bytes(signature)
        code, _, found = _keygen(data, "find-principals", "-s", str(sig), "-f", allowed_signers)
        principal = found.split("\n", 1)[0].strip()
        if code != 0 or not principal:
            code, _, seen = _keygen(data, "check-novalidate", "-n", NAMESPACE, "-s", str(sig))
            key = seen.rsplit(" key ", 1)[-1] if code == 0 else f"an unreadable signature: {seen}"
            return f"its signer ({key}) is not in allowed_signers {allowed_signers}"
        code, _, said = _keygen(data, "verify", "-f", allowed_signers, "-I", principal, "-n", NAMESPACE,
                                "-s", str(sig))  # fmt: skip
        if code != 0:
            return f"its signature by {principal} does not verify ({said})"
    return None
