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


class DrivenRun:
    """A step and the run driven for it in this doit process."""

    def __init__(self, step: Step, project: Project, *, retries: int = 0) -> None:
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
        # The phase being driven and when it started, until its time is
        # recorded in the handle (by `advance` into the phase that ends it,
        # or `end_phase`); None between phases.
        self.clock: tuple[str, str] | None = None

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
