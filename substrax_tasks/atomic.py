"""Atomic file writes: a reader sees the old file or the new one, whole."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class JsonPieces(Protocol):
    """A value that writes its own compact JSON, a piece at a time (a
    manifest's packed entries, a hash cache's records): a large one is then
    never held whole in text, nor as a structure of Python objects."""

    def json_pieces(self) -> Iterator[str]: ...


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0o600, *, tail: bytes = b"") -> None:
    """Write `data` then `tail` to a temp file beside `path`, fsync, rename
    over `path`."""
    _write_atomic(path, [data, tail], mode)


def write_pieces_atomic(
    path: Path, pieces: Iterable[bytes], mode: int = 0o600, *,
    before_rename: Callable[[Path], None] | None = None,
) -> None:  # fmt: skip
    """Write `pieces`, as they come, to a temp file beside `path`, fsync,
    call `before_rename` with the temp file (whole by then: to sign it),
    rename over `path`: a large document is never held whole."""
    _write_atomic(path, pieces, mode, before_rename)


def _write_atomic(
    path: Path, pieces: Iterable[bytes], mode: int, before_rename: Callable[[Path], None] | None = None
) -> None:
    """Write `pieces`, as they come, to a temp file beside `path`, fsync,
    rename over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(Path(tmp))
        Path(tmp).replace(path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if exc.filename is None:  # a write or flush: say which file, so a full disk is named
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any, mode: int = 0o600, indent: int | None = 1) -> None:
    """Sorted keys; indented for people to read, or (`indent=None`) compact,
    which json encodes in C, written a piece at a time: for large machine
    files (manifests, caches)."""
    if indent is None:
        _write_atomic(path, (text.encode() for text in _compact_json(data)), mode)
        return
    encoded = json.dumps(data, indent=indent, sort_keys=True).encode()
    write_bytes_atomic(path, encoded, mode, tail=b"\n")


CHUNK = 250  # items of a list or dict encoded at a time (json holds ~1 KB of fragments for each)


def _compact_json(data: Any) -> Iterator[str]:
    """`json.dumps(data, sort_keys=True, separators=(",", ":"))` and a
    newline, in pieces: the lists and dicts among the values of a top-level
    dict are encoded a chunk of items at a time. Encoded whole, json builds
    every fragment of the document before joining them (~16 MB for a
    manifest of 20,000 files, whose text is 3 MB)."""

    def dumps(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))

    if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
        yield dumps(data) + "\n"  # never a JsonPieces: those are values of a top-level dict
        return
    yield "{"
    for at, key in enumerate(sorted(data)):
        yield ("," if at else "") + dumps(key) + ":"
        value = data[key]
        if isinstance(value, JsonPieces):
            yield from value.json_pieces()
        elif isinstance(value, list) and len(value) > CHUNK:
            yield "["
            for start in range(0, len(value), CHUNK):
                yield ("," if start else "") + dumps(value[start : start + CHUNK])[1:-1]
            yield "]"
        elif isinstance(value, dict) and len(value) > CHUNK and all(isinstance(k, str) for k in value):
            names = sorted(value)
            yield "{"
            for start in range(0, len(names), CHUNK):
                part = {name: value[name] for name in names[start : start + CHUNK]}
                yield ("," if start else "") + dumps(part)[1:-1]
            yield "}"
        else:
            yield dumps(value)
    yield "}\n"
