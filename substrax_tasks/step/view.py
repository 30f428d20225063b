"""What of the project a run sees, the same on every backend: the step's
declared inputs and the environment's lock file, nothing else.

ssh and skypilot upload exactly `files`; the local sandbox hides the rest
(`hidden`), so that a step that works here works there. Why only what is
declared: the up-to-date key and the run cache's key cover the declared
inputs, so an output is the one its key says only if the run could read
nothing else. (A key over every tracked file would rerun every step after
any edit of any file, the README or the dodo.py itself.) A failed run
names what was hidden that its log mentions (`left_out`, see
remote/hints.py), and a command that names an undeclared project file is
refused before anything is launched (`check_command_in_view`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from substrax_tasks._remote.env import lock_file
from substrax_tasks.constants import LOCK_COMPANIONS
from substrax_tasks.errors import SpecError
from substrax_tasks.step.spec import StepSpec

# Never named in a failure: no step declares these, and a run is not meant to read them.
ALWAYS_EXCLUDED = (".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
                   ".doit.db", ".doit.db.bak", ".doit.db.dat", ".doit.db.dir")  # fmt: skip


@dataclass(frozen=True)
class ProjectView:
    files: list[str]  # project-relative: the declared inputs and the lock file, what a remote gets
    hidden: list[str] = field(default_factory=list)  # here, not in the view ("dir" for a whole folder)
    left_out: list[str] = field(default_factory=list)  # hidden less caches and outputs: named in a failure


def shown_paths(project: Path, inputs: Sequence[str]) -> list[str]:
    """The inputs (without a folder's "/") and the environment's lock file
    (the first found) with what it is read with, each once."""
    lock = lock_file(str(project))
    locks = [lock, *LOCK_COMPANIONS.get(lock, ())] if lock else []
    shown: list[str] = []
    for path in [*(i.rstrip("/") for i in inputs), *locks]:
        if path not in shown:
            shown.append(path)
    return shown


def written_paths(spec: StepSpec) -> list[str]:
    """What the run writes, without a folder's "/": its outputs and its
    checkpoints folder (bound or put in place at its path on every backend)."""
    return [o.rstrip("/") for o in spec.outputs] + (
        [spec.checkpoints.rstrip("/")] if spec.checkpoints else []
    )


def project_view(
    project: Path, state_dir: Path, inputs: Sequence[str], written: Sequence[str] = ()
) -> ProjectView:
    """The view of `project` for a step with `inputs` that writes `written`
    (written_paths: what the run makes is never named as left out)."""
    shown = shown_paths(project, inputs)
    hidden: list[str] = []
    for entry in sorted(project.iterdir()):
        hidden += _hide(project, entry.name, shown)
    quiet = set(ALWAYS_EXCLUDED)
    with contextlib.suppress(ValueError, IndexError):  # the state dir, unless it is elsewhere
        quiet.add(state_dir.resolve().relative_to(project.resolve()).parts[0])
    made = [w.rstrip("/") for w in written]
    left_out = [
        h for h in hidden
        if not quiet & set(h.split("/")) and not any(_within(h, o) or _within(o, h) for o in made)
    ]  # fmt: skip
    return ProjectView(shown, sorted(hidden), left_out)


def check_command_in_view(spec: StepSpec, project: Path) -> None:
    """Refuse a command that names a project file or folder the run would
    not see: it would fail there, or worse, read a file its key does not
    cover. An argv item counts as a path (relative to the project, where the
    command runs), and so does the value of an `--option=value` item. The
    checkpoints folder is the step's own, at its path on every backend:
    naming it (or a file in it) is always allowed, though the first run
    leaves its empty mount point in the project."""
    shown = shown_paths(project, spec.inputs)
    made = written_paths(spec)
    root = os.path.normpath(project)
    for item in spec.command:
        for candidate in _path_words(item):
            full = os.path.normpath(Path(root, candidate))  # an absolute candidate stays itself
            if full == root or not full.startswith(root + os.sep) or not os.path.lexists(full):
                continue
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            # a shown or made path, or a folder holding one (the run sees it, in part)
            if any(_within(rel, s) or _within(s, rel) for s in [*shown, *made]):
                continue
            raise SpecError(
                f"step {spec.step!r}: its command names {rel}, a project file the run would not see "
                f"(a run sees the step's declared inputs only); declare it in inputs=[...]"
            )


def _path_words(item: str) -> list[str]:
    words = [item] if item and "\0" not in item else []
    if item.startswith("-") and "=" in item:
        words.append(item.split("=", 1)[1])
    return [w for w in words if w]


def _within(rel: str, folder: str) -> bool:
    return rel == folder or rel.startswith(folder + "/")


def _hide(project: Path, entry: str, shown: list[str]) -> list[str]:
    """`entry`, or what of it to hide to keep shown paths (inputs) inside
    it visible: its other children, recursively."""
    if any(_within(entry, s) for s in shown):
        return []  # shown, or inside a shown folder
    if not any(s.startswith(entry + "/") for s in shown):
        return [entry]
    hidden: list[str] = []
    for child in sorted((project / entry).iterdir()):
        hidden += _hide(project, f"{entry}/{child.name}", shown)
    return hidden
