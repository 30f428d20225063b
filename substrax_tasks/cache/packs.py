"""Small files packed together: an entry's files below PACK_BELOW are kept as
the concatenation of their contents in pack objects, not one object each.

A file takes whole blocks on disk (4 KiB on ext4 and tmpfs): 50,000 files of
10 bytes took 200 MiB as objects, 500 KB as one pack. A pack is an object
like any other (objects/<ab>/<sha256>, named by its digest, written whole or
not at all, counted by its disk use). Its members are the manifest's
distinct files below the entry's `pack_below`, in the manifest's order:
the entry lists only each pack's digest, size and count of members (the
manifest names each file's digest already), and its signature covers them
as it covers the manifest. A restore writes each
member out hashing it, and the copy is verified against the manifest as a
copied object is: a pack that is damaged, cut short or grown is a damaged
entry. Entries made before packs (no `packs`) name one object per file and
restore as they did.

The layout is a function of the manifest alone (PACK_BELOW, PACK_TARGET,
the manifest's order): two stores of the same outputs make the same packs.
An entry made with another PACK_BELOW still restores: it says its own.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Files below 64 KiB are packed. Below it a file's last block wastes a large
# share of what it takes (up to 4 KiB of every file: 400 times a 10-byte
# one, a tenth of a 40 KiB one); above it the waste is at most 6%, and a file
# kept as its own object is shared by every entry holding it and copied as a
# reflink where the file system can.
PACK_BELOW = 64 << 10
# A pack closes once it holds this much: a restore that needs one small file
# of a huge output reads at most this much of it, and a damaged pack costs
# at most this much to store again.
PACK_TARGET = 64 << 20

Member = tuple[str, int]  # a packed file's sha256 and size


class Members:
    """A pack's members, (sha256, size) each as they come out, held as 32
    raw bytes of digest and 8 of size: keeping a run holds every member
    while its outputs' hash cache is loaded to check them again, and a
    tuple and a hex string each took ~180 bytes a file (issue 29)."""

    __slots__ = ("_digests", "_sizes")

    def __init__(self, items: Iterable[Member] = ()) -> None:
        self._digests = bytearray()
        self._sizes = array("Q")
        for digest, size in items:
            self.append(digest, size)

    def append(self, digest: str, size: int) -> None:
        self._digests += bytes.fromhex(digest)
        self._sizes.append(size)

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[Member]:
        digests = self._digests
        for i, size in enumerate(self._sizes):
            yield digests[32 * i : 32 * i + 32].hex(), size

    def __getitem__(self, window: slice) -> Members:
        part = Members()
        start, stop, _ = window.indices(len(self))
        part._digests = self._digests[32 * start : 32 * max(start, stop)]
        part._sizes = self._sizes[start:stop]
        return part

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):  # as the list it replaces compared
            return list(self) == other
        if not isinstance(other, Members):
            return NotImplemented
        return self._digests == other._digests and self._sizes == other._sizes

    __hash__ = None  # type: ignore[assignment] # mutable, as the list it replaces

    def total(self) -> int:
        """The members' sizes added: the pack's size."""
        return sum(self._sizes)

    def __repr__(self) -> str:
        return f"Members({list(self)!r})"


@dataclass(frozen=True)
class Pack:
    sha256: str
    size: int
    members: Members

    @property
    def rel(self) -> str:
        return f"objects/{self.sha256[:2]}/{self.sha256}"

    def as_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size, "count": len(self.members)}


def small_files(files: Iterable[dict[str, Any]], below: int) -> Members:
    """The manifest's files (its entries of type file) below `below` bytes,
    each distinct digest once, in the manifest's order: what is packed."""
    members = Members()
    seen: set[str] = set()
    for item in files:
        digest, size = item["sha256"], int(item.get("size") or 0)
        if size < below and digest not in seen:
            seen.add(digest)
            members.append(digest, size)
    return members


def plan(files: Iterable[dict[str, Any]]) -> list[Members]:
    """The members of each pack for a manifest's files."""
    packs: list[Members] = [Members()]
    filled = 0
    for digest, size in small_files(files, PACK_BELOW):
        if filled >= PACK_TARGET:
            packs.append(Members())
            filled = 0
        packs[-1].append(digest, size)
        filled += size
    return [members for members in packs if members]


def parse(entry: dict[str, Any], files: Iterable[dict[str, Any]]) -> list[Pack]:
    """An entry's packs, their members from its manifest's `files`;
    ValueError if they are not whole (the caller's Damaged)."""
    found = entry.get("packs", [])
    below = entry.get("pack_below", PACK_BELOW)
    if not isinstance(found, list) or not isinstance(below, int):
        raise ValueError("its packs are not a list with pack_below")
    members = small_files(files, below) if found else Members()
    packs, start = [], 0
    for item in found:
        try:
            count = int(item["count"])
            pack = Pack(str(item["sha256"]), int(item["size"]), members[start : start + count])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"it lists a pack that is not whole: {str(item)[:80]}") from None
        start += count
        if count < 1 or len(pack.members) != count or pack.members.total() != pack.size:
            raise ValueError(f"its pack {pack.sha256[:16]} is not the sum of its members")
        packs.append(pack)
    if start != len(members):
        raise ValueError(f"its packs hold {start} of its {len(members)} small files")
    return packs


def packed(packs: list[Pack]) -> dict[str, Pack]:
    """The pack holding each packed digest."""
    return {digest: pack for pack in packs for digest, _ in pack.members}


def write_pack(
    objects: Path, members: Members, sources: Iterator[tuple[str, str]]
) -> tuple[Path, str, int] | None:
    """The part file of a pack of `members` under the folder `objects`, its
    digest and disk use; None (nothing left) if a source is no longer what
    the manifest says (changed since verified). `sources` are the manifest's
    files, (digest, path), in its order, read on as members are found:
    members come in that order, and no map of every file is held.
    The part file is named as Folder.put's are (a dot first): a trim never
    takes it for an object."""
    folder = objects / secrets.token_hex(1)
    folder.mkdir(mode=0o700, exist_ok=True)
    part = folder / f".pack.{secrets.token_hex(6)}.part"
    sha = hashlib.sha256()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(part, flags, 0o600)  # 0600 whatever the umask: a group-writable object is refused
    try:
        with open(fd, "wb", buffering=1 << 20) as out:  # noqa: PTH123 - a descriptor, made exclusive
            for digest, size in members:
                source = next((path for sha, path in sources if sha == digest), None)
                data = _read(source) if source is not None else b""
                if source is None or len(data) != size or hashlib.sha256(data).hexdigest() != digest:
                    part.unlink()
                    return None
                sha.update(data)
                out.write(data)
            out.flush()
            used = os.fstat(out.fileno()).st_blocks * 512
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return part, sha.hexdigest(), used


def _read(path: str) -> bytes:
    """The contents of the file `path`. A str, not a Path: pathlib interns
    every part of every path it parses, and CPython's table of interned
    strings only grows (~90 bytes a file kept after keeping a run, issue 29)."""
    with open(path, "rb") as source:  # noqa: PTH123 - see above
        return source.read()
