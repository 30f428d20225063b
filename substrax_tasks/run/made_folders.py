"""The folders a run makes in the project for its outputs, and their
removal when the run failed (an exit code, a timeout, a missing output).

The worker makes the folders the outputs go in (`bx/`, `out/` for
`out/a.txt`) in the project where they are missing: bubblewrap binds onto
folders that exist. A failed run should not leave them behind, but the
worker cannot tell which are its own: under `doit -n 4 -P thread` steps
whose outputs share a new `out/` each find it missing, and one removing it
takes it from under another's command. So the client decides, from what
this process knows: the folders missing as this run launched, and the
outputs every step of the loaded dodo declares. A folder is removed only if
this run made it, it is empty (rmdir, never a recursive removal), and it is
no other step's output, nor holds one, nor lies in one: a shared `out/` is
never removed, `runs/lr3/` of `fit:lr3` alone is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path


def absent_folders(root: Path, outputs: Iterable[str]) -> list[str]:
    """The project-relative folders a run of `outputs` makes that do not
    exist now: each folder output, the folder holding each file output, and
    each of their parents inside the project."""
    absent: set[str] = set()
    for out in outputs:
        clean = out.rstrip("/")
        parts = (clean if out.endswith("/") else clean.rpartition("/")[0]).split("/")
        for depth in range(1, len(parts) + 1):
            folder = "/".join(parts[:depth])
            if folder and folder not in absent and not os.path.lexists(root / folder):
                absent.add(folder)
    return sorted(absent)


def remove_made_folders(root: Path, made: Iterable[str], near_another: Callable[[str], bool]) -> list[str]:
    """Remove the folders of `made` that are empty and that `near_another`
    (another step's output, or a folder holding one or lying in one) does
    not keep, deepest first; a folder that stays keeps its parents. Those
    removed, in the order they went."""
    removed: list[str] = []
    kept: set[str] = set()
    for folder in sorted(made, key=lambda rel: (-rel.count("/"), rel)):
        if any(other.startswith(folder + "/") for other in kept):
            kept.add(folder)  # it holds a folder that stayed: not empty, nor to be tried
            continue
        if near_another(folder):
            kept.add(folder)
            continue
        try:
            (root / folder).rmdir()
        except OSError:  # not empty (the run or the user put something there), or gone
            kept.add(folder)
            continue
        removed.append(folder)
    return removed
