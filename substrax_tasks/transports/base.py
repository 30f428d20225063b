"""What the transports share (rsync.py, bucket.py): their figures, their
progress bar and the check of a manifest they bring back.

Paths on both sides are relative to a root folder; a transport never
decides which files matter (the backend lists them) and never promotes
anything (the chain verifies and promotes what it brought back). Its
`download(remote_root, rel_paths, local_root)` copies each path that exists
there (verification against the manifest names the others) and raises
BackendError if the copy broke off.

Progress goes to one rich bar (`progress`) when stderr is a terminal, and
to one summary line otherwise, whatever the transport.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from substrax_tasks.errors import BackendError, OutputsRefused

if TYPE_CHECKING:
    from rich.progress import Progress

# The largest manifest read from a host or a bucket (about 300,000 entries):
# one that sends more is refused before it is parsed, so a hostile host
# cannot exhaust this machine's memory with it.
MAX_MANIFEST_BYTES = 64 << 20


@dataclass(frozen=True)
class TransferStats:
    files: int
    bytes: int
    seconds: float

    def summary(self, what: str) -> str:
        rate = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        size = f"{self.bytes / 1e6:.1f} MB"
        return f"{what}: {self.files} files, {size} in {self.seconds:.1f} s ({rate:.1f} MB/s)"


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
    from substrax_tasks.uptodate.manifests import manifest_module

    if len(data) > MAX_MANIFEST_BYTES:
        raise BackendError(
            f"the manifest {where} is larger than {MAX_MANIFEST_BYTES >> 20} MiB: refused unread, "
            "nothing was fetched (outputs of more than about 300,000 entries: declare fewer, larger "
            "files, an archive for example; otherwise the host is broken or hostile)"
        )
    mod = manifest_module()
    try:
        manifest = json.loads(data)
    except ValueError:
        manifest = None
    problem = _problem(manifest, mod)
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
        (isinstance(entries, list) and all(isinstance(e, dict) and "path" in e for e in entries),
         "its entries are not a list of entries"),
        (isinstance(missing, list) and all(isinstance(m, str) for m in missing),
         "its missing outputs are not a list of paths"),
        (isinstance(digest, str), "it has no digest"),
    ]  # fmt: skip
    problem = next((why for ok, why in checks if not ok), None)
    if problem is not None:
        return problem
    assert isinstance(entries, list)  # checked above
    odd = next((e for e in entries if e.get("type") not in ("file", "dir", "symlink")), None)
    if odd is not None:  # a device, fifo or socket is never an output
        return f"it lists {odd['path']!r} as a {odd.get('type')!r}: outputs are files, folders and symlinks"
    try:
        own = str(mod.entries_digest(entries))
    except (TypeError, ValueError) as exc:
        return f"its entries cannot be digested: {exc}"
    return None if own == digest else f"its digest {str(digest)[:12]} does not match its entries ({own[:12]})"
