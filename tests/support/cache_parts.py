"""What the run cache's tests share: a team folder as the shared store,
the entries a cache folder holds, and whether a doit restored a step."""

from __future__ import annotations

import subprocess
from pathlib import Path


def folder_cache(tmp_path: Path) -> str:
    """A cache table's line naming a shared folder store under `tmp_path`."""
    return f'path = "{tmp_path / "team-cache"}"\n'


def entries(folder: Path) -> list[Path]:
    return sorted((folder / "entries").glob("*.json"))


def restored(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether the doit restored a step from the run cache (its line says so)."""
    return "restored from cache entry" in done.stdout
