"""What `substrax-compute gc` removes, and what may still hold a machine.

Here: the files of finished runs the store no longer needs; the
checkpoints of keys no step of the dodo has any more; how long each
run has left before its lifetime timer; and the remote run folders or
clusters that no handle accounts for (leaked), which `gc --machines`
removes and `status --machines` lists.

Only what is provably this client's is removed: a remote folder or a
cluster marked at launch with the random id of its state folder
(store.client_id), or named by one of its handles. Never by the project's
path or name, which another client may share (CI jobs and containers at
one path, on one host). Anything else that looks alike (another client's,
or marked by an earlier release) is listed, never touched.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks.errors import SubstraxError
from substrax_tasks.step.spec import safe_name
from substrax_tasks.store.phase import Phase

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Backend, KeptCheckpoints, Leak
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.project import Project
    from substrax_tasks.store.run_store import RunStore


# What gc leaves in a run's folder: the handle and what tells how the run went.
KEPT_IN_RUN = ("handle.json", "handle.lock", "status.json", "job.json")


def verified_records(store: RunStore) -> dict[str, dict[str, Any]]:
    """What each step's record says of its verified outputs, by step (steps
    with none, or an unreadable record, are left out)."""
    found = {}
    for path in store.step_records():
        try:
            record = json.loads(path.read_text())
            found[str(record["step"])] = dict(record["verified"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def removable(project: Project, handles: list[RunHandle]) -> list[Path]:
    """The files of finished runs whose outputs are home (promoted, or a
    run that did not succeed) that gc removes, in order; a run whose state
    cannot be told now (a host unreachable) is kept whole."""
    from substrax_tasks.cache.run_cache import ORPHAN_SECONDS

    store = project.store
    referenced = {str(v.get("manifest_file")) for v in verified_records(store).values()}
    found: list[Path] = []
    for handle in handles:
        try:
            status = project.backend_for(handle).status(handle)
        except SubstraxError:
            continue
        outputs_home = handle.state.phase is Phase.PROMOTED or status.state != "succeeded"
        if status.final and outputs_home:
            for path in sorted(store.run_dir(handle.run_id).iterdir()):
                kept = path.name in KEPT_IN_RUN or path.name.endswith(".log") or str(path) in referenced
                if not kept:
                    found.append(path)
    old = time.time() - ORPHAN_SECONDS  # a restore in progress stages there
    restores = store.restore_dir
    found += sorted(p for p in restores.iterdir() if p.lstat().st_mtime < old) if restores.is_dir() else []
    return found


def kept_checkpoints(project: Project, handles: list[RunHandle]) -> tuple[list[KeptCheckpoints], list[str]]:
    """Every step's checkpoints, one per step and key: the folders in the
    store (RunStore.checkpoints_dir), then those each backend keeps
    elsewhere (a bucket); and, for each place that could not be asked, why."""
    from substrax_tasks.backends.base import KeptCheckpoints

    store = project.store
    root = store.root / "checkpoints"
    kept = [
        KeptCheckpoints(step.name, folder.name, str(folder),
                        functools.partial(store.remove_checkpoints_folder, folder))
        for step in (sorted(root.iterdir()) if root.is_dir() else []) if step.is_dir()
        and not step.name.startswith(".")
        for folder in sorted(step.iterdir()) if folder.is_dir() and not folder.name.startswith(".")
    ]  # fmt: skip
    problems: list[str] = []
    seen = {k.where for k in kept}
    # Only runs of a step with checkpoints make snapshots elsewhere: a project
    # with none asks no backend (and reaches no bucket).
    with_checkpoints = [h for h in handles if h.spec.checkpoints is not None]
    for name, backend in _places(project, with_checkpoints) if with_checkpoints else ():
        try:
            elsewhere = backend().checkpoints_kept_elsewhere()
        except SubstraxError as exc:
            problems.append(f"{name}: its checkpoints could not be listed: {exc}")
            continue
        kept += [k for k in elsewhere if k.where not in seen]
        seen.update(k.where for k in elsewhere)
    return kept, problems


def stale_checkpoints(
    project: Project, keys: Mapping[str, str | None], handles: list[RunHandle], kept: list[KeptCheckpoints]
) -> list[KeptCheckpoints]:
    """Of the checkpoints `kept`, those of keys no step of the dodo has now:
    `keys` maps each step of the dodo that declares checkpoints to its key
    now (None: not known, as its inputs are refused; all its checkpoints are
    kept). Those of a run that may still be going (its host unreachable, or
    not ended) are kept: a doit reattaches it."""
    wanted = {(safe_name(step), key[:16]) for step, key in keys.items() if key is not None}
    unknown = {safe_name(step) for step, key in keys.items() if key is None}
    found = [k for k in kept if k.step not in unknown and (k.step, k.key[:16]) not in wanted]
    stale = {(k.step, k.key[:16]) for k in found}
    going: set[tuple[str, str]] = set()
    for handle in handles:  # only the runs of those keys are asked: each may be a connection
        of = (safe_name(handle.step), str(handle.state.key or handle.spec_digest)[:16])
        if of not in stale or handle.state.verdict or handle.state.phase is Phase.PROMOTED:
            continue
        try:
            ended = project.backend_for(handle).status(handle).final
        except SubstraxError:
            ended = False
        if not ended:
            going.add(of)
    return [k for k in found if (k.step, k.key[:16]) not in going]


def _places(project: Project, handles: list[RunHandle]) -> Iterator[tuple[str, Callable[[], Backend]]]:
    """One backend per place runs may be: each distinct pinned settings of
    a run not torn down, and the project's configuration (the handles of its
    runs may be gone). Made when asked, so a handle this release cannot use
    is one problem among the places, not the end of the listing."""
    seen: set[str] = set()
    for handle in handles:
        key = repr((handle.backend, sorted(handle.settings.items())))
        if key not in seen and not _released(handle):
            seen.add(key)
            yield handle.backend, functools.partial(project.backend_for, handle)
    for name, pinned in project.settings.items():
        key = repr((name, sorted(pinned.items())))
        if key not in seen:
            seen.add(key)
            yield name, functools.partial(_configured, project, name)


def _released(handle: RunHandle) -> bool:
    """The run was torn down (a backend this release does not know: not)."""
    from substrax_tasks.backends.registry import backend_class

    try:
        return backend_class(handle.backend).released(handle)
    except KeyError:
        return False


def _configured(project: Project, name: str) -> Backend:
    from substrax_tasks.backends.registry import backend_class

    cls = backend_class(name)
    return cls(cls.Settings.model_validate(project.settings[name]), project.store)


def find_leaks(project: Project, handles: list[RunHandle]) -> tuple[list[Leak], list[str]]:
    """The leaks of every place the project's runs may be, and for each
    place that could not be asked, why."""
    found: set[Leak] = set()
    problems: list[str] = []
    # Runs copied in with the state folder are another client's: their
    # folders are neither live nor known here (they carry that client's mark).
    own = [h for h in handles if project.store.owns(h)]
    for name, backend in _places(project, handles):
        try:
            found.update(backend().leaks(str(project.root), own))
        except SubstraxError as exc:
            problems.append(f"{name}: {exc}")
    return sorted(found, key=lambda leak: (leak.backend, leak.where, leak.name)), problems


def remove_leaks(project: Project, handles: list[RunHandle], *, dry_run: bool = False
                 ) -> tuple[list[Leak], list[str]]:  # fmt: skip
    """Remove (or with `dry_run` only list) every leak that is provably the
    project's; (those, problems)."""
    leaks, problems = find_leaks(project, handles)
    removed = []
    for leak in (leak for leak in leaks if leak.ours):
        try:
            if not dry_run:
                leak.remove()
            removed.append(leak)
        except SubstraxError as exc:
            problems.append(f"could not remove {leak.name} on {leak.where}: {exc}")
    return removed, problems
