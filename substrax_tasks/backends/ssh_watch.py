"""The remote side of an SSH fetch: one `manifest.py --watch` on one channel.

The remote script stamps the outputs, prints their manifest and waits; once
the copy has ended, `check()` asks it whether the outputs held still all
along (see `watch` in remote/manifest.py). One interpreter starts and one
manifest crosses the network per fetch, and a thread receives and parses
that manifest (3 MB for 20,000 files) while rsync copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import threading
from collections.abc import Callable
from typing import Any

import paramiko

from substrax_tasks.errors import BackendError

CHECK_REQUEST = b"check\n"  # remote/manifest.py CHECK_REQUEST
ANSWER_TIMEOUT = 120.0  # seconds for an answer once asked (as for any remote command)


def _digest_of_line_matches(line: bytes, digest: object) -> bool:
    """Whether `digest` is the sha256 of the entries' canonical JSON, read
    from the line itself: remote/manifest.py writes that JSON verbatim
    after '"entries":', and the entries cannot hold ',"missing":' outside a
    string (a quote in a path is escaped). False for a line in another
    form: the entries are then digested again by verification."""
    if not isinstance(digest, str):
        return False
    prefix = b'{"digest":"' + digest.encode() + b'","entries":'
    end = line.rfind(b',"missing":')
    return line.startswith(prefix) and end > len(prefix) and (
        hashlib.sha256(memoryview(line)[len(prefix) : end]).hexdigest() == digest
    )


class ManifestWatch:
    """A running `manifest.py BASE OUTPUT... --cache FILE --watch`."""

    def __init__(self, channel: paramiko.Channel, host: str) -> None:
        self.channel = channel
        self.host = host
        # Called from the reader thread if the script ends without a
        # manifest (a refused tree): the fetch stops its copy at once.
        self.on_failure: Callable[[], None] | None = None
        self._lines: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._manifest: tuple[dict[str, Any], bytes] | None = None
        self._exit_code: int | None = None
        self._stderr = b""
        self._broken: str | None = None
        self._ended = threading.Event()
        self._asked = False
        # The manifest's digest is that of its entries (checked on arrival).
        self.digest_checked = False
        self._thread = threading.Thread(target=self._read, name="manifest-watch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ reading
    def _read(self) -> None:
        pending = bytearray()
        delivered = 0
        try:
            while chunk := self.channel.recv(1 << 16):
                start = len(pending)
                pending += chunk
                while (end := pending.find(b"\n", start)) >= 0:
                    self._deliver(bytes(pending[: end + 1]), delivered)
                    delivered += 1
                    del pending[: end + 1]
                    start = 0
            self._exit_code = self.channel.recv_exit_status()
            err = bytearray()
            while part := self.channel.recv_stderr(1 << 16):
                err += part
            self._stderr = bytes(err)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            self._broken = str(exc) or type(exc).__name__
        finally:
            self._ended.set()
            self._lines.put(None)
            if delivered == 0 and self.on_failure is not None:
                self.on_failure()

    def _deliver(self, line: bytes, index: int) -> None:
        """The manifest is parsed, and its digest checked, here in the
        reader thread while the copy runs."""
        if index == 0:
            try:
                manifest = json.loads(line)
            except ValueError:
                manifest = None
            if isinstance(manifest, dict) and isinstance(manifest.get("entries"), list):
                self._manifest = (manifest, line)
                self.digest_checked = _digest_of_line_matches(line, manifest.get("digest"))
        self._lines.put(line)

    def _next_line(self, what: str) -> bytes:
        try:
            line = self._lines.get(timeout=ANSWER_TIMEOUT)
        except queue.Empty:
            raise BackendError(f"{what} from {self.host}: no answer after {ANSWER_TIMEOUT:.0f} s") from None
        if line is None:
            self._thread.join(timeout=10)
            raise self._failure(what)
        return line

    def _failure(self, what: str) -> Exception:
        """What went wrong once the script ended without answering: its own
        refusal (ManifestError, with its message) or a broken connection."""
        message = self._stderr.decode(errors="replace").strip()
        if self._exit_code == 1 and message.startswith("manifest.py:"):
            from substrax_tasks.manifest_cache import ManifestError

            return ManifestError(message)
        why = self._broken or f"exit {self._exit_code}: {message[-1500:] or 'no message'}"
        return BackendError(f"{what} from {self.host} broke off ({why}); the fetch can be tried again")

    # ------------------------------------------------------------ answers
    def refusal(self) -> Exception | None:
        """The script's refusal of the tree (a ManifestError), if it has
        already ended with one; None otherwise. Does not wait."""
        from substrax_tasks.manifest_cache import ManifestError

        if not self._ended.is_set() or self._manifest is not None:
            return None
        failure = self._failure("the outputs' manifest")
        return failure if isinstance(failure, ManifestError) else None

    def manifest(self) -> tuple[dict[str, Any], bytes]:
        """The manifest and its canonical JSON line, as received."""
        line = self._next_line("the outputs' manifest")
        if self._manifest is None:
            raise BackendError(
                f"the outputs' manifest from {self.host} arrived damaged ({len(line)} bytes); "
                "the fetch can be tried again"
            )
        return self._manifest

    def ask(self) -> None:
        """Ask whether the outputs held still since their manifest was taken
        (once the copy has ended); `check()` reads the answer. Does not wait."""
        if self._asked:
            return
        self._asked = True
        try:
            self.channel.sendall(CHECK_REQUEST)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise BackendError(f"asking {self.host} whether the outputs changed failed: {exc}") from None

    def check(self) -> str | None:
        """The answer (asked now if `ask()` was not called): None if the
        outputs held still since their manifest was taken, otherwise why
        not. Call after manifest()."""
        self.ask()
        line = self._next_line("the outputs' check")
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get("unchanged"), bool):
            raise BackendError(f"the outputs' check from {self.host}: unexpected answer {line[:200]!r}")
        return None if answer["unchanged"] else str(answer.get("why") or "they changed")

    def close(self) -> None:
        """End the conversation: the script, waiting for a request, sees the
        end of its input and exits."""
        with contextlib.suppress(Exception):
            self.channel.shutdown_write()
        with contextlib.suppress(Exception):
            self.channel.close()
        self._thread.join(timeout=10)
