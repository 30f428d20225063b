"""A verified fetch over SSH: rsync, and one `manifest.py --watch` on one channel.

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
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import paramiko

from substrax_tasks.backends.base import Fetched
from substrax_tasks.errors import BackendError
from substrax_tasks.transports.rsync import RsyncTransport

CHECK_REQUEST = b"check\n"  # remote/manifest.py CHECK_REQUEST
ANSWER_TIMEOUT = 120.0  # seconds for an answer once asked (as for any remote command)
CLOSE_GRACE_SECONDS = 10.0  # for an ssh whose input was closed to end by itself
# remote/manifest.py's messages for a tree that changed while it was read
MANIFEST_RACES = ("changed while it was read", "was replaced while the manifest was taken")


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

    def __init__(self, channel: Channel, host: str) -> None:
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


class Channel(Protocol):
    """The parts of a paramiko Channel a watch uses (ProcessChannel has them too)."""

    def recv(self, nbytes: int) -> bytes: ...

    def recv_exit_status(self) -> int: ...

    def recv_stderr(self, nbytes: int) -> bytes: ...

    def sendall(self, data: bytes) -> None: ...

    def shutdown_write(self) -> None: ...

    def close(self) -> None: ...


class ProcessChannel:
    """A remote command run by an OpenSSH client process, seen as a Channel:
    for hosts reached through an ssh config file (SkyPilot's clusters).

    Its output is read by one reader (the watch's thread), which closes
    each stream once it has read it to the end: `close()`, called from
    another thread, ends the process but never closes a file the reader may
    still be reading (its descriptor could be reused under it)."""

    def __init__(self, argv: list[str]) -> None:
        # stderr to a file: a pipe read only at the end could fill and stall it
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed once read to the end
        self._stderr_read = False
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)

    def recv(self, nbytes: int) -> bytes:
        stdout = self.proc.stdout
        assert stdout is not None
        data = os.read(stdout.fileno(), nbytes)
        if not data:
            stdout.close()
        return data

    def recv_exit_status(self) -> int:
        return self.proc.wait()

    def recv_stderr(self, nbytes: int) -> bytes:
        """What the process wrote on stderr, once it has ended (b"" before)."""
        if self.proc.poll() is None or self._stderr.closed:
            return b""
        if not self._stderr_read:  # the process wrote it all, moving the shared offset
            self._stderr_read = True
            self._stderr.seek(0)
        data = self._stderr.read(nbytes)
        if not data:
            self._stderr.close()
        return data

    def sendall(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def shutdown_write(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def close(self) -> None:
        """End the process: given its input's end, it exits by itself; killed
        if it has not within CLOSE_GRACE_SECONDS."""
        self.shutdown_write()
        try:
            self.proc.wait(timeout=CLOSE_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def watched_fetch(
    watch: ManifestWatch,
    transport: RsyncTransport,
    root: str,
    outputs: list[str],
    *,
    staging: Path,
    changed: str,
) -> Fetched:
    """Copy `outputs` from `root` on the host into a fresh `staging` while
    the host's `manifest.py --watch` (`watch`) takes their manifest, hashing
    each file here as it arrives (StagedHasher); the host's last check is
    left to `Fetched.confirm()`, so that it overlaps verification. `changed`
    says what a change at the source during the fetch means, for the errors.

    Three things overlap the copy: the host's manifest (taken between two
    stat stamps of the tree: remote/manifest.py `watch`), receiving it here,
    and hashing each file as rsync finishes it, so verification finds those
    hashes ready; and the host's last check overlaps that verification."""
    from substrax_tasks.manifest_cache import ManifestError
    from substrax_tasks.staged_hashes import StagedHasher

    # Fresh each time: a killed rsync leaves temp files (and a file since
    # deleted there would stay here), which verification would then refuse.
    shutil.rmtree(staging, ignore_errors=True)
    watch.on_failure = transport.stop  # a refused tree: no need to copy it all
    try:
        try:
            with StagedHasher(staging) as hasher:
                transport.download(root, outputs, staging, on_file=hasher.add)
        except BackendError:
            refusal = watch.refusal()  # a refused tree says more than the rsync it stopped
            if refusal is not None:
                raise refusal from None
            raise
        manifest, line = watch.manifest()
        watch.ask()  # the copy is over: the host checks while this side verifies
    except ManifestError as exc:
        watch.close()
        # a file growing or replaced while the host hashed it is the same
        # race as outputs that change under the copy: not a verdict on the run
        if any(race in str(exc) for race in MANIFEST_RACES):
            raise BackendError(f"{changed}: {exc}") from None
        raise
    except BaseException:
        watch.close()
        raise

    def confirm() -> None:
        try:
            why = watch.check()
        except ManifestError as exc:  # the tree it accepted is now refused: it changed
            raise BackendError(f"{changed}: {exc}") from None
        finally:
            watch.close()
        if why is not None:
            raise BackendError(f"{changed} ({why})")

    return Fetched(
        staging, manifest, hashes=hasher.entries, manifest_json=line,
        digest_checked=watch.digest_checked, confirm=_once(confirm),
    )  # fmt: skip


def _once(call: Callable[[], None]) -> Callable[[], None]:
    """`call`, run on the first call only (later calls do nothing)."""
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            call()

    return once
