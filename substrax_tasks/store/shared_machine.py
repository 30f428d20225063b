"""A machine several runs use in turn (a warm SkyPilot cluster, `reuse =
true`), and the piece of its life each run is charged.

The machine's life is cut into consecutive pieces, one per run that used
it, with no gap and no overlap. Each seat of the machine (a step's share of
its GPUs: one seat when steps do not share it side by side) is cut alone:
the first run in a seat is charged from the launch (provisioning, setup),
every run from its claim until the next claim of that seat; the last one
until the machine went down (a teardown, `gc --machines`, or its autodown
seen), else, projected, until its lease's keep-warm ends (the last release
plus `idle_minutes`).

The record, one JSON file a machine, kept after the machine is gone (its
runs' costs are read from it):

    {"machine": NAME, "launched_at": EPOCH, "idle_seconds": S,
     "claims": [{"run_id": ID, "at": EPOCH, "seat": N}, ...],
     "released": {ID: EPOCH, ...}, "down_at": EPOCH | null}

Written by the backend that keeps the machine warm, under a lock (the runs
of several doits claim it), atomically.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.console import emit
from substrax_tasks.store.run_store import SET_ASIDE


@dataclass(frozen=True)
class Claim:
    run_id: str
    at: float
    seat: int


@dataclass(frozen=True)
class MachineLife:
    machine: str
    launched_at: float
    idle_seconds: float
    claims: tuple[Claim, ...]
    released: dict[str, float] = field(default_factory=dict)
    down_at: float | None = None

    @classmethod
    def parse(cls, data: object) -> MachineLife | None:
        """The life in `data`, None when it is not one (damaged, or of an older release)."""
        if not isinstance(data, dict):
            return None
        try:
            claims = tuple(Claim(str(c["run_id"]), float(c["at"]), int(c["seat"])) for c in data["claims"])
            released = {str(k): float(v) for k, v in dict(data.get("released") or {}).items()}
            down = data.get("down_at")
            return cls(str(data["machine"]), float(data["launched_at"]), float(data["idle_seconds"]),
                       claims, released, None if down is None else float(down))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            return None

    def dump(self) -> dict[str, Any]:
        return {
            "machine": self.machine, "launched_at": self.launched_at, "idle_seconds": self.idle_seconds,
            "claims": [{"run_id": c.run_id, "at": c.at, "seat": c.seat} for c in self.claims],
            "released": self.released, "down_at": self.down_at,
        }  # fmt: skip


@dataclass(frozen=True)
class Piece:
    """The part of a machine's life one run is charged: from `start` to
    `end` (None: the run holds it still); `projected` when `end` is the
    keep-warm's end foreseen, the machine not yet seen gone."""

    start: float
    end: float | None
    projected: bool


def piece_of(life: MachineLife, run_id: str) -> Piece | None:
    """The run's piece of the machine's life; None if it never claimed it."""
    mine = next((c for c in life.claims if c.run_id == run_id), None)
    if mine is None:
        return None
    seat = sorted((c for c in life.claims if c.seat == mine.seat), key=lambda c: c.at)
    index = seat.index(mine)
    start = life.launched_at if index == 0 else mine.at
    if index + 1 < len(seat):
        return Piece(start, max(start, seat[index + 1].at), False)
    if life.down_at is not None:
        return Piece(start, max(start, life.down_at), False)
    if run_id not in life.released:
        return Piece(start, None, False)
    # The lease keeps the machine warm idle_seconds past the last step it held.
    return Piece(start, max(start, max(life.released.values()) + life.idle_seconds), True)


def read_life(path: Path) -> MachineLife | None:
    try:
        return MachineLife.parse(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    from filelock import FileLock

    lock = FileLock(str(path.with_suffix(".lock")), thread_local=False, is_singleton=False)
    with lock:
        yield


def change_life(path: Path, change: Callable[[MachineLife | None], MachineLife | None]) -> None:
    """Read, change and write the machine's life under its lock (None:
    leave it as it is). A damaged one is moved aside first, kept and said:
    the runs that used the machine read their cost as not known (store/cost.py),
    and a new machine of that name starts a record of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        life = read_life(path)
        if life is None and path.exists():
            aside = path.with_name(f"{path.name}{SET_ASIDE}{time.strftime('%Y%m%dT%H%M%S')}")
            path.replace(aside)
            emit(f"the record of machine {path.stem}, {path}, was damaged: moved aside to {aside}; "
                 "the cost of the runs that used it is not known", err=True)  # fmt: skip
        changed = change(life)
        if changed is not None:
            write_json_atomic(path, changed.dump())


def launched(path: Path, machine: str, idle_seconds: float, first: Claim) -> None:
    """A new machine, asked for by its first claim's run at that claim's time."""
    life = MachineLife(machine, first.at, idle_seconds, (first,))
    change_life(path, lambda _old: life)


def claimed(path: Path, run_id: str, at: float, seat: int, idle_seconds: float | None = None) -> None:
    """The run claims the machine at `at`. With no record of the machine's
    life (a damaged one was moved aside), with `idle_seconds` its keep-warm,
    a record begins at this claim: the runs before it read as not known."""

    def add(life: MachineLife | None) -> MachineLife | None:
        if life is None and idle_seconds is not None:
            return MachineLife(path.stem, at, idle_seconds, (Claim(run_id, at, seat),))
        if life is None or any(c.run_id == run_id for c in life.claims):
            return None
        return replace(life, claims=(*life.claims, Claim(run_id, at, seat)))

    change_life(path, add)


def released(path: Path, run_id: str, at: float | None = None) -> None:
    def add(life: MachineLife | None) -> MachineLife | None:
        if life is None or life.down_at is not None or run_id in life.released:
            return None
        return replace(life, released={**life.released, run_id: time.time() if at is None else at})

    change_life(path, add)


def went_down(path: Path, at: float | None = None, *, seen: bool = False) -> None:
    """The machine is gone: taken down at `at` (now by default); `seen`
    gone only (its autodown, at a moment not known), it went at the latest
    when its keep-warm ended."""

    def end(life: MachineLife | None) -> MachineLife | None:
        if life is None or life.down_at is not None:
            return None
        down = time.time() if at is None else at
        if seen and life.released:
            down = min(down, max(life.released.values()) + life.idle_seconds)
        return replace(life, down_at=down)

    if path.is_file():
        change_life(path, end)
