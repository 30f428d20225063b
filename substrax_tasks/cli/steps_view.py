"""`substrax-compute steps`: every remote step the dodo file declares, and
where it stands: up to date, restored from the run cache, stale (with the
first reason `why` gives), running, failed, or never run.

Whether a step is up to date is `uptodate.check.status`, the function doit's
check and `why` call: this view cannot disagree with either. What a run is
doing is its backend's status, as `status` reads it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from substrax_tasks.backends.base import RunStatus
from substrax_tasks.cli.status_view import clock, plain_table, seconds_between
from substrax_tasks.errors import BackendError, HandleError
from substrax_tasks.store.selection import group_of
from substrax_tasks.uptodate.check import read_record, status

if TYPE_CHECKING:
    from substrax_tasks.run.step_driver import StepDriver
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.project import Project

# Each state a step can be in, in the order the summary counts them; the
# JSON's words (scripts read them) and the table's.
STATES = {
    "up_to_date": "up to date",
    "restored": "restored",
    "stale": "stale",
    "running": "running",
    "failed": "failed",
    "never_run": "never run",
}
COLUMNS = ("step", "state", "backend", "run", "duration", "detail")


@dataclass(frozen=True)
class StepState:
    """Where one step stands. `run_id`: the run this row is about (the one
    going, the one that failed, the one whose outputs are in place, or the
    run that made a restored cache entry); `detail`: the reason it is stale,
    how a run failed, or which cache entry it was restored from."""

    step: str
    state: str  # a key of STATES
    backend: str
    run_id: str | None = None
    detail: str = ""
    started_at: str | None = None
    ended_at: str | None = None
    exit_code: int | None = None
    restored_from: str | None = None

    @property
    def seconds(self) -> float | None:
        return seconds_between(self.started_at, self.ended_at)

    def record(self) -> dict[str, Any]:
        """One step of `steps --json`. Scripts read these keys: add new
        ones, never rename or drop one."""
        return {
            "step": self.step,
            "group": group_of(self.step),
            "state": self.state,
            "backend": self.backend,
            "run_id": self.run_id,
            "detail": self.detail,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "duration_seconds": None if self.seconds is None else round(self.seconds, 1),
            "exit_code": self.exit_code,
            "restored_from": self.restored_from,
        }


def run_status(project: Project, handle: RunHandle) -> RunStatus:
    try:
        return project.backend_for(handle).status(handle)
    except (HandleError, BackendError) as exc:  # settings this release cannot use, a host away
        return RunStatus("unknown", message=str(exc))


def step_state(
    project: Project, driver: StepDriver, values: dict[str, Any] | None, latest: RunHandle | None
) -> StepState:
    """Where the step of `driver` stands; `latest`: its latest run in the
    store, `values`: doit's saved values of its task (None: unknown)."""
    step = driver.step
    now = run_status(project, latest) if latest is not None else None
    if latest is not None and now is not None and not now.final and now.state != "unknown":
        return StepState(step.name, "running", latest.backend, latest.run_id, now.message or "",
                         now.started_at, None, None)  # fmt: skip
    verdict = status(step, values)
    verified = read_record(step).get("verified")
    verified = verified if isinstance(verified, dict) else {}
    if verdict.up_to_date:
        run_id = str(verified.get("run_id") or "") or None
        if verified.get("restored_from"):
            made = verified.get("provenance") or {}
            label = str(verified["restored_from"])
            where = f"{made.get('backend')}, {made.get('host')}, {made.get('time')}"
            detail = f"from {label} (the run ran on {where})"
            return StepState(step.name, "restored", str(made.get("backend") or step.backend), run_id, detail,
                             made.get("started_at"), made.get("ended_at"), restored_from=label)  # fmt: skip
        made_by = now if latest is not None and latest.run_id == run_id else None
        if made_by is None and run_id is not None:
            try:
                made_by = run_status(project, project.store.read(run_id))
            except HandleError:  # removed since: its outputs are still the verified ones
                made_by = None
        return StepState(step.name, "up_to_date", step.backend, run_id, "",
                         made_by.started_at if made_by else None, made_by.ended_at if made_by else None,
                         made_by.exit_code if made_by else None)  # fmt: skip
    reason = verdict.reasons[0]
    if latest is not None and now is not None and now.final and now.state != "succeeded":
        how = now.message or (f"exit code {now.exit_code}" if now.exit_code is not None else now.state)
        return StepState(step.name, "failed", latest.backend, latest.run_id, f"{now.state}: {how}",
                         now.started_at, now.ended_at, now.exit_code)  # fmt: skip
    if latest is None and not verified:
        return StepState(step.name, "never_run", step.backend)
    return StepState(step.name, "stale", step.backend, latest.run_id if latest else None, reason,
                     now.started_at if now else None, now.ended_at if now else None)  # fmt: skip


def summary(states: list[StepState]) -> str:
    """One line, every state counted: "14 up to date, 3 restored, 1 stale, 0 running, ..."."""
    counts = Counter(s.state for s in states)
    return ", ".join(f"{counts[key]} {word}" for key, word in STATES.items())


def steps_json(states: list[StepState]) -> str:
    counts = Counter(s.state for s in states)
    return json.dumps({
        "summary": {key: counts[key] for key in STATES},
        "steps": [s.record() for s in states],
    }, indent=1)  # fmt: skip


def steps_table(states: list[StepState]) -> str:
    cells = [
        [s.step, STATES[s.state], s.backend, s.run_id or "-",
         "-" if s.seconds is None else clock(s.seconds), s.detail or "-"]
        for s in states
    ]  # fmt: skip
    if not states:
        return "the dodo file declares no remote step"
    return summary(states) + "\n\n" + plain_table(list(COLUMNS), cells)
