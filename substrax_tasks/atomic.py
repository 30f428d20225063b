"""Atomic file writes: a reader sees the old file or the new one, whole."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0o600, *, tail: bytes = b"") -> None:
    """Write `data` then `tail` to a temp file beside `path`, fsync, rename
    over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.write(tail)
            f.flush()
            os.fsync(f.fileno())
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
    which json encodes in C: for large machine files (manifests, caches)."""
    separators = (",", ":") if indent is None else None
    # encoded straight from json's str, the newline written after it: one
    # copy fewer of a 3 MB manifest than `(text + "\n").encode()`
    encoded = json.dumps(data, indent=indent, sort_keys=True, separators=separators).encode()
    write_bytes_atomic(path, encoded, mode, tail=b"\n")
