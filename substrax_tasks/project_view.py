"""What of the project a run sees, the same on every backend.

In a git work tree: the tracked files, the step's declared inputs and the
environment's lock file. ssh and skypilot upload exactly these; the local
sandbox hides the rest (`hidden`), so that a step that works here works
there. A failed run names what was left out that its log mentions
(`left_out`, see remote/sandbox.py). A project that is not a git work tree
(or tracks nothing yet) is seen whole, but for caches and the state dir.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from substrax_tasks.config import ENV_LOCK_FILES

ALWAYS_EXCLUDED = (".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
                   ".doit.db", ".doit.db.bak", ".doit.db.dat", ".doit.db.dir")  # fmt: skip
GIT_TIMEOUT_SECONDS = 60


@dataclass(frozen=True)
class ProjectView:
    files: list[str]  # project-relative, what a remote gets (inputs and the lock added)
    hidden: list[str] = field(default_factory=list)  # here, not in the view ("dir" for a whole folder)
    left_out: list[str] = field(default_factory=list)  # hidden, less the caches: named in a failure


def project_view(
    project: Path,
    state_dir: Path,
    inputs: Sequence[str],
    outputs: Sequence[str] = (),
    excludes: Sequence[str] = (),
) -> ProjectView:
    """The view of `project` for a step with `inputs` and `outputs` (which
    the run makes, so never named as left out); `excludes`: rsync patterns
    the ssh copy also leaves out, applied by it."""
    lock = next((name for name in ENV_LOCK_FILES if (project / name).is_file()), None)
    shown = [i.rstrip("/") for i in inputs] + ([lock] if lock else [])
    quiet = set(ALWAYS_EXCLUDED)
    with contextlib.suppress(ValueError, IndexError):  # the state dir is elsewhere
        quiet.add(state_dir.resolve().relative_to(project.resolve()).parts[0])
    listing = _git_listing(project)
    if listing is None:
        skip = {*quiet, *excludes}
        files = sorted(entry.name for entry in project.iterdir() if entry.name not in skip)
        return ProjectView(_with(files, shown))
    tracked, others = listing
    if (project / ".git").exists():
        others.append(".git")
    hidden: list[str] = []
    for entry in others:
        hidden += _hide(project, entry, shown)
    made = [o.rstrip("/") for o in outputs]
    left_out = [
        h for h in hidden
        if not quiet & set(h.split("/")) and not any(_within(h, o) or _within(o, h) for o in made)
    ]  # fmt: skip
    return ProjectView(_with(tracked, shown), sorted(hidden), left_out)


def _within(rel: str, folder: str) -> bool:
    return rel == folder or rel.startswith(folder + "/")


def _with(files: list[str], shown: list[str]) -> list[str]:
    taken = set(files)
    return files + [s for s in shown if s not in taken]


def _git_listing(project: Path) -> tuple[list[str], list[str]] | None:
    """(tracked files, untracked or ignored entries: a folder holding no
    tracked file is one entry); None when git tracks nothing here."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(project), "ls-files", "-z", "-t", "--cached", "--others", "--directory"],
            capture_output=True, check=True, timeout=GIT_TIMEOUT_SECONDS,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    tracked: list[str] = []
    others: list[str] = []
    for item in listed.decode(errors="surrogateescape").split("\0"):
        if item:
            tag, path = item[0], item[2:]
            (others if tag == "?" else tracked).append(path.rstrip("/"))
    return (tracked, others) if tracked else None


def _hide(project: Path, entry: str, shown: list[str]) -> list[str]:
    """`entry`, or what of it to hide to keep shown paths (inputs) inside
    it visible: its other children, recursively."""
    if any(s == entry or entry.startswith(s + "/") for s in shown):
        return []  # shown, or inside a shown folder
    below = [s for s in shown if s.startswith(entry + "/")]
    if not below:
        return [entry]
    hidden: list[str] = []
    for child in sorted((project / entry).iterdir()):
        hidden += _hide(project, f"{entry}/{child.name}", shown)
    return hidden
