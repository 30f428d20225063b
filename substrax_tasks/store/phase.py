"""A run's durable phase: how far the chain has driven it, recorded in its
handle (`phase`) the moment each phase ends, so that a later doit picks
the run up where it stopped.

The phase only moves forward. Fetching a promoted run again (its outputs
changed here) is a phase of its own, `refetch`, which starts a new round of
fetch and promote: `refetches` counts the rounds, and (rounds, position)
only grows. The chain writes it (RunStore.advance); backends never do.

Imports nothing of pydantic: a no-op doit reads no handle, but the driver
that imports this module is on its path.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from substrax_tasks.errors import SubstraxError


class PhaseError(SubstraxError):
    """A phase recorded out of order: the chain went back on its record."""


class Phase(str, enum.Enum):
    """In the order the chain reaches them. The values are what handles on
    disk hold (str-valued: a handle written before this enum reads the same)."""

    CREATED = "created"  # the handle is written: nothing slow or paid happened yet
    LAUNCHED = "launched"  # the backend provisioned, connected or prepared the run's folder
    SET_UP = "set_up"
    SYNCED = "synced"
    STARTED = "started"  # the command started: never started again
    REFETCH = "refetch"  # promoted before; its outputs changed here, so they are fetched again
    FETCHED = "fetched"  # outputs staged here and verified against the run's manifest
    PROMOTED = "promoted"  # outputs home and recorded in the step record

    @property
    def position(self) -> int:
        return _ORDER.index(self)

    def reached(self, other: Phase) -> bool:
        """This phase is `other` or one after it."""
        return self.position >= other.position

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> Phase | None:
        """The phase a handle's state records; None when it records none
        this release knows (the run is taken as not yet created)."""
        value = state.get("phase")
        try:
            return cls(value) if isinstance(value, str) else None
        except ValueError:
            return None


_ORDER = tuple(Phase)


def reached(state: Mapping[str, Any], phase: Phase) -> bool:
    """The handle's state records `phase` or one after it."""
    current = Phase.of(state)
    return current is not None and current.reached(phase)


def progress(state: Mapping[str, Any]) -> tuple[int, int]:
    """How far a run went, as a key that only grows: (refetch rounds, position)."""
    current = Phase.of(state)
    return int(state.get("refetches") or 0), -1 if current is None else current.position


def moved_to(state: Mapping[str, Any], phase: Phase, run_id: str) -> dict[str, Any]:
    """The changes that record `phase` after what `state` records; PhaseError
    for a move back. A phase recorded again is no move (a fetch that failed
    to promote is fetched again). `refetch` is entered from `promoted` alone,
    and starts a new round."""
    current = Phase.of(state)
    if phase is Phase.REFETCH:
        if current is not Phase.PROMOTED:
            raise PhaseError(f"run {run_id}: only a promoted run is fetched again (it is {_name(current)})")
        return {"phase": phase.value, "refetches": int(state.get("refetches") or 0) + 1}
    if current is not None and not phase.reached(current):
        raise PhaseError(f"run {run_id}: its phase cannot go back from {_name(current)} to {phase.value}")
    return {"phase": phase.value}


def _name(phase: Phase | None) -> str:
    return "unrecorded" if phase is None else phase.value
