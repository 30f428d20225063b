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

    def backend(self, handle: RunHandle) -> Backend:
        return self.project.backend_for(handle)

    def save(self, handle: RunHandle, **changes: Any) -> RunHandle:
        """Record `changes` in the run's handle; it is the handle held from now on."""
        self.handle = self.project.store.update_state(handle, **changes)
        return self.handle

    def advance(self, handle: RunHandle, phase: Phase, **changes: Any) -> RunHandle:
        """Record that the run reached `phase` (only ever forward), with `changes`."""
        self.handle = self.project.store.advance(handle, phase, **changes)
        return self.handle

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
