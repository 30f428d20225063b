"""The handle: the durable record of one run.

Everything needed to reach the run again, from the handle alone: the spec,
the backend's validated settings (paths absolute), the core's state (a typed
`CoreState`) and the backend's state. The backend's state is the backend's
own: the core carries it and never reads or writes a key of it (each backend
reads it through its own model, `Backend.State`; tests/unit/test_import_graph.py
checks the core never indexes it). Where it lives and how it is written:
run_store.py.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from substrax_tasks.errors import HandleError
from substrax_tasks.step.spec import StepSpec
from substrax_tasks.store.phase import Phase

HANDLE_VERSION = 3
# Version 2 kept the core's keys and the backend's in one `state` dict: it is
# read and split (`_from_version_2`), and written as 3 the next time.
MIGRATED_VERSIONS = frozenset({2})


class Attempt(BaseModel):
    """One attempt of a run's command on one machine. A run has one; a step
    with `preemptions=N` gets a new one each time its machine is lost while
    the command runs (run/step_driver.py), up to N more. Times are ISO 8601
    UTC strings, as the phase times (run/timeline.py): `seconds()` sums them."""

    model_config = ConfigDict(extra="forbid")

    number: int  # 1 for the run's first
    machine: str  # where it ran, in words a user knows (Backend.ran_on)
    launched_at: str  # when its machine was asked for (launch, or relaunch)
    started_at: str | None = None  # when its command was started; None: not yet
    ended_at: str | None = None  # when it ended, or was seen lost; None: going
    snapshot: str | None = None  # the checkpoints it started from (Backend.snapshot_of); None: none
    outcome: str | None = None  # how it ended: a final state (RunStatus.state), e.g. "succeeded", "lost"
    message: str | None = None  # why, when the backend said (the machine lost: how)
    # True: a relaunch with no preemption left after it, which a backend may
    # give a machine that is not preempted (SkyPilot's on_demand_last_attempt)
    last: bool | None = None

    def seconds(self, start: str | None, end: str | None) -> float:
        """Seconds from one of its times to another (0 if either is missing)."""
        if start is None or end is None:
            return 0.0
        return (datetime.datetime.fromisoformat(end) - datetime.datetime.fromisoformat(start)).total_seconds()

    @property
    def command_seconds(self) -> float:
        """How long its command ran (started to ended; 0 if it never started or still runs)."""
        return max(self.seconds(self.started_at, self.ended_at), 0.0)


def checkpoints_words(snapshot: str) -> str:
    """The checkpoints an attempt started from (Attempt.snapshot: a
    snapshot's name, or what a backend put in place), as a user reads it."""
    return f"the checkpoints it last kept ({snapshot})"


class CoreState(BaseModel):
    """What the core records of a run, and all it reads of the handle's
    state. Unknown keys are refused: a typo fails at once."""

    model_config = ConfigDict(extra="forbid")

    project: str | None = None  # the project folder the run was submitted from
    # The id of the state folder that launched it (store/client.py); None: an earlier release's run
    client_id: str | None = None
    phase: Phase | None = None  # how far the chain drove it (phase.py); written by RunStore.advance alone
    refetches: int = 0  # rounds of `refetch` (phase.py)
    key: str | None = None  # the step's run key when it was submitted (uptodate)
    key_parts: dict[str, Any] | None = None
    times: dict[str, Any] = {}  # phase -> its start and end (run/timeline.py)
    slot: dict[str, Any] | None = None  # the max_parallel slot it holds: {"pool", "index"}
    verdict: dict[str, Any] | None = None  # the chain's own end for it: {"state", "message"}
    fetch_refusals: int = 0  # fetches refused in a row (run/outputs_phases.py)
    manifest_digest: str | None = None  # of the outputs fetched and verified
    cost_usd: float | None = None  # what the run cost, where known (`substrax-compute report` shows it)
    # Its command's attempts, oldest first; the last is the one going (`preemptions`)
    attempts: list[Attempt] = []
    # The machine it held, its price and cap (store/cost.py): {"asked_at", "released_at", "hourly_cost", ...}
    machine: dict[str, Any] | None = None

    @field_validator("phase", mode="before")
    @classmethod
    def _phase_known(cls, value: Any) -> Any:
        """A phase this release does not know reads as none (not yet created)."""
        return Phase.of({"phase": value})

    def reached(self, phase: Phase) -> bool:
        """The run's recorded phase is `phase` or one after it."""
        return self.phase is not None and self.phase.reached(phase)

    def command_seconds_spent(self) -> float:
        """How long the command ran in the attempts that ended: a step's
        `timeout` bounds its running time summed over attempts."""
        return sum(a.command_seconds for a in self.attempts if a.ended_at is not None)


class RunHandle(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = HANDLE_VERSION
    run_id: str
    step: str
    backend: str
    settings: dict[str, Any]
    spec: StepSpec
    spec_digest: str
    created_at: str
    state: CoreState = CoreState()
    # The backend's own: carried, never read by the core (Backend.State reads it).
    backend_state: dict[str, Any] = {}


def _from_version_2(data: dict[str, Any]) -> dict[str, Any]:
    """A version-2 handle as version 3: its one `state` dict split into the
    core's keys and the backend's (all the others)."""
    mixed = data.get("state")
    mixed = mixed if isinstance(mixed, dict) else {}
    core = {name: value for name, value in mixed.items() if name in CoreState.model_fields}
    own = {name: value for name, value in mixed.items() if name not in CoreState.model_fields}
    return {**data, "version": HANDLE_VERSION, "state": core, "backend_state": own}


def read_handle(path: Path) -> RunHandle:
    """Read one handle; refuse any other version with what to do about it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HandleError(f"{path}: no such run handle") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HandleError(
            f"{path}: unreadable handle ({exc}); the file is damaged: "
            f"remove {path.parent} to forget this run"
        ) from None
    version = data.get("version") if isinstance(data, dict) else None
    if version in MIGRATED_VERSIONS:
        data = _from_version_2(data)
    elif version != HANDLE_VERSION:
        raise HandleError(
            f"{path}: handle version {version!r} cannot be used by this release "
            f"(it reads version {HANDLE_VERSION}); reach that run with the release "
            f"that made it, or remove {path.parent} to forget it"
        )
    try:
        return RunHandle.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise HandleError(
            f"{path}: damaged handle ({'.'.join(map(str, first['loc']))}: {first['msg']}); "
            f"remove {path.parent} to forget this run"
        ) from None

