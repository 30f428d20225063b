"""One step's run as the chain drives it: what the phases share (the step,
its project, the run's handle, what was fetched or restored) and the one
place the run's durable record is written.

The driver (step_driver.py) is this, with the phases as doit actions; the
modules of the phases (earlier_run, outputs_phases, cached_runs) take this
and never import the driver.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError

if TYPE_CHECKING:  # pydantic models: imported by the phases that act, not by a no-op doit
    from substrax_tasks.backends.base import Backend, Fetched
    from substrax_tasks.cache.run_cache import Restored
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.phase import Phase
    from substrax_tasks.store.project import Project
    from substrax_tasks.uptodate.check import Step

RETRY_BACKOFF_SECONDS = 2.0
# The durable phase (store/phase.py) each phase of the chain ends with, when
# it ends well; the run phase ends with the command, which moves no phase.
ENDED_BY = {
    "launch": "launched", "setup": "set_up", "sync": "synced", "fetch": "fetched", "promote": "promoted",
}
_T = TypeVar("_T")
# What the record and the run's handle hold, in place of a declared input's
# digest (or a lock file's), for a file edited while the run went: no
# content of it is the one the run saw, so no later key ever matches.
EDITED_MID_RUN = "changed while the run went"


def view_changes(was: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two key parts (uptodate.key_parts): the declared
    inputs and the lock files by path, then the other parts by name. The
    one test of a run's view against its key, for a relaunch (step_driver)
    and for a run's end (outputs_phases)."""
    changed: list[str] = []
    for files in ("inputs", "environment"):
        old, new = was.get(files) or {}, now.get(files) or {}
        changed += sorted(path for path in set(old) | set(new) if old.get(path) != new.get(path))
    others = (set(was) | set(now)) - {"inputs", "environment"}
    changed += sorted(part for part in others if was.get(part) != now.get(part))
    return changed


def marked_edited(parts: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """The key parts a run is recorded with when files of its view changed
    while it went: each such input (and lock file) marked EDITED_MID_RUN,
    so whatever content it has later, the key differs (the step runs again)
    and `why` names the file."""
    marked = dict(parts)
    inputs, new_inputs = dict(parts.get("inputs") or {}), now.get("inputs") or {}
    for path in set(inputs) | set(new_inputs):
        if inputs.get(path) != new_inputs.get(path):
            inputs[path] = EDITED_MID_RUN
    environment, new_environment = dict(parts.get("environment") or {}), now.get("environment") or {}
    for name in set(environment) | set(new_environment):
        if environment.get(name) != new_environment.get(name):
            environment[name] = EDITED_MID_RUN
    marked.update(inputs=inputs, environment=environment)
    return marked


class DrivenRun:
    """A step and the run driven for it in this doit process."""

    def __init__(self, step: Step, project: Project, *, retries: int = 0,
                 near_another: Callable[[str], bool] = lambda folder: True) -> None:
        self.step = step
        self.spec = step.spec
        self.root = step.root
        self.project = project
        self.retries = retries
        self.handle: RunHandle | None = None
        self.fetched: Fetched | None = None
        self.restored: Restored | None = None  # the outputs came from the run cache, not a run
        # The step's own check held in this doit (step.StepCheck): a run now
        # is asked for by `-a` or a user's uptodate item, and is a real one.
        self.check_held = False
        self.parts: dict[str, Any] = {}
        # The declared inputs (or lock file) found changed as the run's
        # outputs were promoted: the run is then neither kept in the run
        # cache nor recorded up to date (outputs_phases.edited_while_running).
        self.edited: list[str] = []
        # The phase being driven and when it started, until its time is
        # recorded in the handle (by `advance` into the phase that ends it,
        # or `end_phase`); None between phases.
        self.clock: tuple[str, str] | None = None
        # The project's folders this process found missing as it launched
        # the run (its outputs' folders, which the run makes), and whether a
        # folder is another step's (made_folders.py): without the dodo's
        # steps at hand, every folder is taken to be.
        self.made_folders: list[str] = []
        self.near_another = near_another

    def backend(self, handle: RunHandle) -> Backend:
        return self.project.backend_for(handle)

    def save(self, handle: RunHandle, **changes: Any) -> RunHandle:
        """Record `changes` in the run's handle; it is the handle held from now on."""
        self.handle = self.project.store.update_state(handle, **changes)
        return self.handle

    def advance(self, handle: RunHandle, phase: Phase, **changes: Any) -> RunHandle:
        """Record that the run reached `phase` (only ever forward), with
        `changes`; and, in the same write, the time of the phase being
        driven when `phase` is the one it ends with."""
        if self.clock is not None and ENDED_BY.get(self.clock[0]) == phase.value:
            from substrax_tasks.run.timeline import with_phase_time  # a phase acts: not on a no-op's path

            changes["times"] = with_phase_time(handle.state.times, self.clock[0], self.clock[1], "ok")
            self.clock = None
        self.handle = self.project.store.advance(handle, phase, **changes)
        return self.handle

    def start_phase(self, name: str) -> None:
        from substrax_tasks.run.timeline import now  # a phase acts: not on a no-op's path

        self.clock = (name, now())

    def end_phase(self, outcome: str) -> RunHandle | None:
        """Record the time of the phase being driven, which ended with
        `outcome` without moving the run's phase (the command ended; the
        phase failed or was interrupted). The handle held from now on is the
        one on disk, with what the backend noted meanwhile."""
        clock, self.clock = self.clock, None
        if clock is None or self.handle is None:
            return self.handle
        from substrax_tasks.run.timeline import with_phase_time

        times = with_phase_time(self.handle.state.times, clock[0], clock[1], outcome)
        return self.save(self.handle, times=times)

    def remove_made_folders(self) -> None:
        """The run failed (an exit code, a timeout, a missing output): the
        empty folders it made for its outputs that are no other step's go,
        and the step says which."""
        from substrax_tasks.run.made_folders import remove_made_folders  # a run failed: not a no-op's path

        made, self.made_folders = self.made_folders, []
        removed = remove_made_folders(self.root, made, self.near_another)
        if removed:
            emit(f"{self.spec.step}: removed the empty output folder(s) it made: "
                 + ", ".join(f"{folder}/" for folder in removed))

    def retrying(self, what: str, call: Callable[[], _T]) -> _T:
        """Retry failures of the machinery, never a failed command."""
        for attempt in range(self.retries + 1):
            try:
                return call()
            except BackendError as exc:
                if attempt == self.retries:
                    raise
                wait = RETRY_BACKOFF_SECONDS * (attempt + 1)
                emit(
                    f"{self.spec.step}: {what} failed ({exc}); "
                    f"retry {attempt + 1} of {self.retries} in {wait:.0f} s"
                )
                time.sleep(wait)
        raise AssertionError("unreachable")
