"""Trees shared by hard links rather than copied: the local backend's
fetch (the outputs a run wrote, linked into staging) and SkyPilot's COPY
mount of the files a run sees. A copy only across file systems."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def link_tree(source: Path, dest: Path) -> None:
    """Hard-link a file or tree (symlinks copied as links; copies across
    file systems). What is already at `dest` stays."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and not source.is_symlink():
        shutil.copytree(source, dest, symlinks=True, copy_function=_link_or_copy, dirs_exist_ok=True)
    elif source.exists() or source.is_symlink():
        _link_or_copy(str(source), str(dest))


def _link_or_copy(source: str, dest: str) -> None:
    if os.path.lexists(dest):
        return
    if Path(source).is_symlink():
        Path(dest).symlink_to(Path(source).readlink())
        return
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)
