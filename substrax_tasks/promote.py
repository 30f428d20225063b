"""Promote verified staged outputs into their final paths, one rename each.

A half-written output never stands at its final path: each output is moved
into place by a single rename (the previous version moved aside first, then
dropped). When the staging folder is on another file system, the output is
first copied next to its final path and renamed from there.

A promotion is journaled in the run's folder before its first rename, and
the journal goes once the last is done. A kill in between leaves outputs
half old, half new, and folders moved aside or copied half: `recover`
(the step's next launch, under its lock, before anything reads them)
finishes the promotion from the staged files, which stay until the last
rename (a copy from another file system leaves them for teardown).
"""

from __future__ import annotations

import errno
import json
import secrets
import shutil
from pathlib import Path

from substrax_tasks._atomic import write_json_atomic

JOURNAL = "promotion.json"


def remove_path(path: Path) -> None:
    """Remove a file, symlink or folder tree (a symlink is never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _next_to(final: Path, tag: str) -> Path:
    # secrets, not uuid: uuid imports platform, 3 ms of every no-op doit.
    return final.with_name(f".{final.name}.substrax-{tag}-{secrets.token_hex(4)}")


def promote_one(staged: Path, final: Path) -> bool:
    """Move `staged` to `final`; True if by renames alone (the very files
    staged now stand there), False if it had to be copied."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        staged.replace(final) if not final.is_dir() or final.is_symlink() else _swap_dir(staged, final)
        return True
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        # Another file system: copy beside the final path, then rename.
        beside = _next_to(final, "in")
        try:
            if staged.is_dir() and not staged.is_symlink():
                shutil.copytree(staged, beside, symlinks=True)
            else:
                shutil.copy2(staged, beside, follow_symlinks=False)
            promote_one(beside, final)
        except OSError as copy_failed:
            # shutil names the source: name the file system that is full
            if copy_failed.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(copy_failed.errno, copy_failed.strerror, str(beside)) from copy_failed
            raise
        finally:  # a copy made half (a full disk) takes no room there
            if beside.exists() or beside.is_symlink():
                remove_path(beside)
        # `staged` stays (teardown removes it): a tree removed half, after a
        # kill, would be promoted again by `recover` over the whole copy.
        return False


def _swap_dir(staged: Path, final: Path) -> None:
    """A folder cannot be renamed over a non-empty folder: move the old one
    aside first (the path is briefly absent, never half-written)."""
    aside = _next_to(final, "old")
    final.rename(aside)
    try:
        staged.rename(final)
    except OSError:
        aside.rename(final)  # put the old one back
        raise
    remove_path(aside)


def promote(staging_root: Path, project: Path, outputs: list[str], journal: Path) -> bool:
    """Move each output from `staging_root/<out>` to `project/<out>`. True
    if every one was moved by renames alone, so the project holds the very
    files that were staged (and verified there)."""
    write_json_atomic(journal, {"staging_root": str(staging_root), "project": str(project),
                                "outputs": outputs})
    renamed = True
    for out in outputs:
        rel = out.rstrip("/")
        renamed = promote_one(staging_root / rel, project / rel) and renamed
    journal.unlink()
    return renamed


def recover(journal: Path) -> bool:
    """Finish the promotion `journal` records, if a kill interrupted it:
    each output still staged is promoted, and what the kill left beside the
    outputs (an old version moved aside, a copy made half) is removed.
    True if there was one to finish."""
    try:
        data = json.loads(journal.read_text())
        staging_root, project, outputs = Path(data["staging_root"]), Path(data["project"]), data["outputs"]
    except FileNotFoundError:
        return False
    for out in outputs:
        rel = str(out).rstrip("/")
        staged, final = staging_root / rel, project / rel
        if staged.exists() or staged.is_symlink():
            promote_one(staged, final)
        beside = f".{final.name}.substrax-"  # moved aside ("old") or copied half ("in")
        for left in final.parent.iterdir() if final.parent.is_dir() else []:
            if left.name.startswith(beside):
                remove_path(left)
    journal.unlink()
    return True
