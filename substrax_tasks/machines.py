"""What may still hold a machine: how long each run has left before its
lifetime timer, and the remote run folders or clusters that no handle
accounts for (leaked), which `substrax-compute gc --machines` removes.

Only what is provably this project's is removed: a remote folder marked
with the project at launch or named by one of its handles, a cluster named
by one of its handles. Anything else that looks alike (another project's,
or made before the mark) is listed, never touched.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from substrax_tasks.errors import SubstraxError

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Backend
    from substrax_tasks.backends.skypilot import SkypilotBackend
    from substrax_tasks.handle import RunHandle
    from substrax_tasks.runs import Project


@dataclass(frozen=True)
class Leak:
    """A remote run folder or a cluster no live handle accounts for."""

    backend: str
    where: str  # the host, or "SkyPilot"
    name: str  # the folder's path there, or the cluster's name
    ours: bool  # provably this project's: `gc --machines` removes it
    remove: Callable[[], None] = field(compare=False, repr=False)


def lifetime_left(handle: RunHandle, now: float | None = None) -> float | None:
    """Seconds until the run's lifetime timer ends it (negative: overdue);
    None for a run that holds no machine (local, never armed, torn down)."""
    timer = handle.state.get("watchdog")
    if handle.state.get("torn_down") or not isinstance(timer, dict):
        return None
    armed, seconds = timer.get("armed_at"), timer.get("seconds")
    if not isinstance(armed, (int, float)) or not isinstance(seconds, (int, float)):
        return None
    return float(armed) + float(seconds) - (time.time() if now is None else now)


def cluster_leaks(backend: SkypilotBackend, handles: list[RunHandle]) -> list[Leak]:
    """Clusters of the prefix that no live handle names. Those a handle of
    the project named are its own; the rest may be another project's (the
    prefix is shared by default), so are listed, never removed."""
    runs = [h for h in handles if h.backend == backend.name]
    live = {h.state.get("cluster") for h in runs if not h.state.get("torn_down")}
    ours = {h.state.get("cluster") for h in runs}
    prefix = f"{backend.settings.cluster_prefix}-"
    return [
        Leak(backend.name, "SkyPilot", name, name in ours, functools.partial(backend.sky().down, name))
        for name in backend.sky().cluster_names()
        if name.startswith(prefix) and name not in live
    ]


def _places(project: Project, handles: list[RunHandle]) -> Iterator[tuple[str, Callable[[], Backend]]]:
    """One backend per place runs may be: each distinct pinned settings of
    a run not torn down, and the project's configuration (the handles of its
    runs may be gone). Made when asked, so a handle this release cannot use
    is one problem among the places, not the end of the listing."""
    config = project.config
    seen: set[str] = set()
    for handle in handles:
        key = repr((handle.backend, sorted(handle.settings.items())))
        if key not in seen and not handle.state.get("torn_down"):
            seen.add(key)
            yield handle.backend, functools.partial(project.backend_for, handle)
    for name in config.backends:
        key = repr((name, sorted(config.pinned(name, project.root).items())))
        if key not in seen:
            seen.add(key)
            yield name, functools.partial(_configured, project, name)


def _configured(project: Project, name: str) -> Backend:
    from substrax_tasks.backends import backend_class

    return backend_class(name)(project.config.backend_settings(name, project.root), project.store)


def find_leaks(project: Project, handles: list[RunHandle]) -> tuple[list[Leak], list[str]]:
    """The leaks of every place the project's runs may be, and for each
    place that could not be asked, why."""
    found: set[Leak] = set()
    problems: list[str] = []
    for name, backend in _places(project, handles):
        try:
            found.update(backend().leaks(str(project.root), handles))
        except SubstraxError as exc:
            problems.append(f"{name}: {exc}")
    return sorted(found, key=lambda leak: (leak.backend, leak.where, leak.name)), problems


def remove_leaks(project: Project, handles: list[RunHandle]) -> tuple[list[Leak], list[str]]:
    """Remove every leak that is provably the project's; (removed, problems)."""
    leaks, problems = find_leaks(project, handles)
    removed = []
    for leak in leaks:
        if not leak.ours:
            continue
        try:
            leak.remove()
            removed.append(leak)
        except SubstraxError as exc:
            problems.append(f"could not remove {leak.name} on {leak.where}: {exc}")
    return removed, problems
