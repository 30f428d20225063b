"""What a run records of its phases' times, for `substrax-compute report`.

The driver writes each phase's start and end into the run's handle as it
records the phase (`state["times"]`), and a restore from the run cache its
time into the step record. Each time names the `doit` that made it: an id
made once per process (`DOIT_ID`), so "the latest doit" is the one whose id
the newest record carries, whatever ran before or after it in other
processes. A handle written before this release has no times: the report
shows the run without bars.

    state["times"][PHASE]    {"start": ISO, "end": ISO, "doit": ID, "outcome": "ok"|"failed"|"interrupted"}

PHASE is one of PHASES; a phase driven again (a reattach, a refetch) keeps
its latest time.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

PHASES = ("launch", "setup", "sync", "run", "fetch", "promote")
OUTCOMES = ("ok", "failed", "interrupted")


def now() -> str:
    """The time now as the records write it: UTC, ISO 8601, to the millisecond."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


# This process's doit: the time it first drove a phase (this module is
# imported then, never by a no-op), so ids sort as the doits began to act;
# its pid and a random part, so two doits of the same moment differ.
DOIT_ID = (
    f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S.%f}Z-{os.getpid()}-{os.urandom(3).hex()}"
)


def with_phase_time(recorded: Mapping[str, Any], phase: str, start: str, outcome: str) -> dict[str, Any]:
    """The handle's `times` (`recorded`) with `phase` recorded as ending now."""
    times = dict(recorded)
    times[phase] = {"start": start, "end": now(), "doit": DOIT_ID, "outcome": outcome}
    return times


def phase_times(times: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Those of the phase times a handle's state records (`times`) that this
    release can read (an old handle: none)."""
    return {
        phase: dict(entry)
        for phase, entry in times.items()
        if phase in PHASES and isinstance(entry, Mapping)
        and isinstance(entry.get("start"), str) and isinstance(entry.get("end"), str)
    }
