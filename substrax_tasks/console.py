"""Progress lines from the chain and the backends, one writer at a time.

Under `doit -n N -P thread` several steps print at once, and concurrent
writes to one text stream crashed CPython 3.11 (SIGSEGV in TextIOWrapper,
gh-119506): every line goes through this lock.
"""

from __future__ import annotations

import sys
import threading

OUTPUT_LOCK = threading.Lock()


def emit(text: str, *, err: bool = False) -> None:
    with OUTPUT_LOCK:
        stream = sys.stderr if err else sys.stdout
        stream.write(text if text.endswith("\n") else text + "\n")
        stream.flush()


class TextSink:
    """Log bytes to doit's (possibly captured, text-only) stdout."""

    def write(self, data: bytes) -> int:
        with OUTPUT_LOCK:
            sys.stdout.write(data.decode(errors="replace"))
        return len(data)

    def flush(self) -> None:
        with OUTPUT_LOCK:
            sys.stdout.flush()
