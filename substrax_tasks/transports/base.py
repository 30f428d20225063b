"""The transport contract: put files there, bring outputs back.

Paths on both sides are relative to a root folder; a transport never
decides which files matter (the backend lists them) and never promotes
anything (the chain verifies and promotes what it brought back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


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
    name: ClassVar[str]

    @abstractmethod
    def upload(self, local_root: Path, rel_paths: list[str], remote_root: str) -> TransferStats:
        """Copy `local_root/<rel>` to `remote_root/<rel>` for each path (a
        folder with everything in it). Creates `remote_root`."""

    @abstractmethod
    def download(
        self,
        remote_root: str,
        rel_paths: list[str],
        local_root: Path,
        on_file: Callable[[str], None] | None = None,
    ) -> TransferStats:
        """Copy `remote_root/<rel>` to `local_root/<rel>` for each path that
        exists there. Raises BackendError if the copy broke off.

        `on_file` (optional) is told the relative path of each file as the
        copy finishes it, from the copy's thread; the file may reach its
        final path a moment later. A hint for work that can overlap the
        copy (hashing), never proof that a file arrived whole."""
