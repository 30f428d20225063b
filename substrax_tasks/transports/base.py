"""The transports' contract (`Transport`, which rsync.py and bucket.py
implement) and what they share: their figures, their progress bar and the
check of a manifest they bring back.

Progress goes to one rich bar (`progress`) when stderr is a terminal, and
to one summary line otherwise, whatever the transport.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks.errors import BackendError, OutputsRefused

if TYPE_CHECKING:
    from rich.progress import Progress

# The largest manifest read from a host or a bucket (about 300,000 entries):
# one that sends more is refused before it is parsed, so a hostile host
# cannot exhaust this machine's memory with it.
MAX_MANIFEST_BYTES = 64 << 20


class DiskFullHere(BackendError):
    """A download this machine's disk (or quota) had no room for. A
    BackendError, as every failed copy is (a checkpoints snapshot that
    fails is said and tried again); an outputs fetch tells it as the full
    disk it is (`full_disk`)."""

    def __init__(self, message: str, code: int, filename: str) -> None:
        super().__init__(message)
        self.code = code
        self.filename = filename

    def full_disk(self) -> OSError:
        return OSError(self.code, "no room for the copy", self.filename)


@dataclass(frozen=True)
class TransferStats:
    files: int
    bytes: int
    seconds: float

    def summary(self, what: str) -> str:
        rate = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        size = f"{self.bytes / 1e6:.1f} MB"
        return f"{what}: {self.files} files, {size} in {self.seconds:.1f} s ({rate:.1f} MB/s)"


class Transport(ABC):
    """How a run's outputs come from where it ran to this machine.

    Paths on both sides are relative to a root folder; a transport never
    decides which files matter (the backend lists them) and never promotes
    anything (the chain verifies and promotes what it brought back).
    tests/contract/test_transport_contract.py holds every implementation to this.
    """

    # Every file and folder `download` writes has its unsafe mode bits
    # cleared as it is written (promote.safe_mode's rule): verification then
    # needs no walk of its own to clear them (Fetched.modes_safe).
    writes_safe_modes = False

    @abstractmethod
    def download(self, remote_root: str, rel_paths: list[str], local_root: Path) -> TransferStats:
        """Called by a backend's fetch, once the run's manifest is read:
        copy `remote_root/<rel>` (a file, or a folder with everything under
        it; a folder with or without its trailing slash) to
        `local_root/<rel>`, making `local_root` if needed and replacing
        what is there. A path that is not there is skipped (verification
        against the manifest names it) and leaves nothing half-made.
        Returns what was copied; raises BackendError if the copy broke off.
        Progress: a bar on a terminal, else one `fetch: ...` summary line."""


def progress(what: str) -> Progress:
    """The bar of a transfer: files done (a `files` field the caller sets),
    bytes done, rate and time left, on stderr. Not started."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn(f"{what}{{task.fields[files]}}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), transient=False, console=Console(stderr=True),
    )  # fmt: skip


def checked_manifest(data: bytes, where: str) -> dict[str, Any]:
    """The manifest in `data` (remote/manifest.py's JSON), checked whole: a
    damaged one (cut short, or entries that do not give its digest) is an
    OutputsRefused (a BackendError) naming `where`, never a verdict on the
    outputs it lists."""
    from substrax_tasks._remote import manifest as remote_manifest

    if len(data) > MAX_MANIFEST_BYTES:
        raise BackendError(
            f"the manifest {where} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: refused unread, "
            "nothing was fetched (outputs of more than about 300,000 entries: declare fewer, larger "
            "files, an archive for example; otherwise the host is broken or hostile)"
        )
    mod = remote_manifest
    problem: str | None = None
    manifest: dict[str, Any] | None = None
    try:
        manifest = mod.load_manifest(data)  # its entries packed: ~130 bytes a file held, not 590
    except mod.ManifestFormatError as exc:
        problem = str(exc)
    except ValueError:
        pass
    problem = problem or _problem(manifest, mod)
    if problem is not None:
        raise OutputsRefused(
            f"the manifest {where} is damaged ({problem}): the run did not finish writing its "
            "outputs, or it was altered since; nothing was fetched"
        )
    assert isinstance(manifest, dict)
    return manifest


def _problem(manifest: object, mod: Any) -> str | None:
    if not isinstance(manifest, dict):
        return "it is not a JSON object"
    version, entries = manifest.get("version"), manifest.get("entries")
    missing, digest = manifest.get("missing"), manifest.get("digest")
    checks = [
        (version == mod.VERSION, f"version {version!r}, expected {mod.VERSION}"),
        # each entry was checked as it was read
        (isinstance(entries, mod.PackedEntries), "its entries are not a list of entries"),
        (isinstance(missing, list) and all(isinstance(m, str) for m in missing),
         "its missing outputs are not a list of paths"),
        (isinstance(digest, str), "it has no digest"),
    ]  # fmt: skip
    problem = next((why for ok, why in checks if not ok), None)
    if problem is not None:
        return problem
    try:
        own = str(mod.entries_digest(entries))
    except (TypeError, ValueError) as exc:
        return f"its entries cannot be digested: {exc}"
    return None if own == digest else f"its digest {str(digest)[:12]} does not match its entries ({own[:12]})"
