"""What a run costs: its machine time and its price, and how much of its
cap is left.

One place computes a cost: `cost_of`, from a list of machine intervals
(each a machine held from when it was asked for to when it was let go, at
an hourly price). A run records the machine of its attempt going
(`CoreState.machine`, read by `machine_intervals`); a run relaunched after
losing its machine (`preemptions`) keeps each lost attempt's machine in
`earlier`, from its launch to when it was found lost, at that attempt's
price (`relaunched_record`): its cost and its cap cover every attempt.

    state["machine"]   {"asked_at": EPOCH, "released_at": EPOCH | None,
                        "hourly_cost": USD | None, "price_from": "hourly_cost" | "catalog" | None,
                        "max_cost": USD | None,
                        "earlier": [{"asked_at": EPOCH, "released_at": EPOCH, "hourly_cost": USD | None}]}

Pure functions of the handle and the time: `status`, the report and the
driver read the same figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks.store.shared_machine import MachineLife, Piece, piece_of, read_life

if TYPE_CHECKING:
    from substrax_tasks.store.handle import RunHandle


@dataclass(frozen=True)
class MachineTime:
    """One machine a run held: from `start` (asked for) to `end` (let go;
    None while it is held), at `hourly_cost` USD an hour (None: unknown)."""

    start: float
    end: float | None
    hourly_cost: float | None
    projected: bool = False  # `end` foreseen: a warm machine's keep-warm, the machine not yet seen gone

    def seconds(self, now: float) -> float:
        return max(0.0, (now if self.end is None else self.end) - self.start)


def machine_seconds(intervals: Iterable[MachineTime], now: float | None = None) -> float:
    """The machine time of all `intervals`, those still held counted to `now`."""
    at = time.time() if now is None else now
    return sum(i.seconds(at) for i in intervals)


def cost_of(intervals: Sequence[MachineTime], now: float | None = None) -> float | None:
    """What `intervals` cost in USD, those still held counted to `now`;
    None when one of them has no known price (a partial sum would look
    like the whole)."""
    if any(i.hourly_cost is None for i in intervals):
        return None
    at = time.time() if now is None else now
    return sum(i.seconds(at) * float(i.hourly_cost or 0.0) / 3600.0 for i in intervals)


def relaunched_record(record: dict[str, Any], now: float, hourly_cost: float | None) -> dict[str, Any]:
    """The machine record of a run relaunched at `now`: the lost attempt's
    machine held until now (it was found lost then: no later attempt pays
    for it), kept in `earlier` at its own price; the new attempt's machine
    asked for now at `hourly_cost` (a spot attempt and an on-demand last
    one differ)."""
    lost = {"asked_at": record["asked_at"], "released_at": now, "hourly_cost": record.get("hourly_cost")}
    return {**record, "asked_at": now, "released_at": None, "hourly_cost": hourly_cost,
            "earlier": [*earlier_records(record), lost]}  # fmt: skip


def earlier_records(record: dict[str, Any]) -> list[dict[str, Any]]:
    earlier = record.get("earlier")
    return [m for m in earlier if isinstance(m, dict)] if isinstance(earlier, list) else []


def _price(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _epoch(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _usd_or_none(value: Any) -> bool:
    return value is None or (_epoch(value) and value >= 0)


def _shown(value: Any) -> str:
    """A damaged value as a message shows it: cut short (it may be anything)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _damage_of(record: dict[str, Any]) -> str | None:
    """What is wrong with a machine record, None if nothing: a field of a
    type or value no release writes (a hand edit, a damaged disk). Its
    figures are then not known, rather than wrong (machine_damage)."""
    earlier = record.get("earlier", [])
    shared = record.get("shared_machine")
    checks = [
        (_epoch(record.get("asked_at")), f"asked_at = {_shown(record.get('asked_at'))}, not a time"),
        (record.get("released_at") is None or _epoch(record.get("released_at")),
         f"released_at = {_shown(record.get('released_at'))}, not a time"),
        *((_usd_or_none(record.get(name)), f"{name} = {_shown(record.get(name))}, not a number of USD")
          for name in ("hourly_cost", "max_cost")),
        (isinstance(earlier, list), f"earlier = {_shown(earlier)}, not a list of machines"),
        *((isinstance(lost, dict) and _epoch(lost.get("asked_at")) and _epoch(lost.get("released_at"))
           and _usd_or_none(lost.get("hourly_cost")), f"earlier holds {_shown(lost)}, not a machine")
          for lost in (earlier if isinstance(earlier, list) else [])),
        (shared is None or isinstance(shared, str), f"shared_machine = {_shown(shared)}, not a path"),
    ]  # fmt: skip
    return next((said for fine, said in checks if not fine), None)


def machine_damage(handle: RunHandle) -> str | None:
    """Why the run's machine record cannot be counted, None when it can
    (or the run has none). What such a run spent is not known: `status`
    and the report show its cost as unknown, and a cap is taken as spent
    (cap_deadline, run/spending.py's budget_spent): a damaged record never
    lets a run spend past its max_cost."""
    record = handle.state.machine
    if record is None:
        return None
    if not isinstance(record, dict):
        return f"machine = {_shown(record)}, not a record"
    damage = _damage_of(record)
    shared = record.get("shared_machine")
    if damage is None and isinstance(shared, str):
        life = read_life(Path(shared))
        if life is None or piece_of(life, handle.run_id) is None:
            return (f"the record of the machine it used in turn with other runs, {shared}, is missing, "
                    "damaged, or begun anew without it")  # fmt: skip
    return damage


def machine_record(handle: RunHandle) -> dict[str, Any] | None:
    """The run's machine record; None when it has none, or a damaged one
    (machine_damage says what: nothing is counted from it, nor written over it)."""
    record = handle.state.machine
    return record if isinstance(record, dict) and _damage_of(record) is None else None


def machine_intervals(handle: RunHandle, *, held_until: float | None = None) -> list[MachineTime]:
    """The machines the run held, from its handle, one per attempt, oldest
    first; none when its record is damaged (machine_damage). One still
    held (no `released_at`) ends at `held_until` when given (the machine
    is known gone, as when the run's lifetime timer took it down), else is open.
    On a machine runs use in turn (a warm cluster), the attempt's machine
    time is the run's piece of its life (store/shared_machine.py)."""
    record = machine_record(handle)
    if record is None:
        return []
    life = shared_life(handle)
    piece = piece_of(life, handle.run_id) if life is not None else None
    if piece is None and isinstance(record.get("shared_machine"), str):
        return []  # its machine's life is missing, damaged, or begun anew without it: its time is not known
    lost = [MachineTime(float(m["asked_at"]), float(m["released_at"]), _price(m.get("hourly_cost")))
            for m in earlier_records(record)]  # fmt: skip
    price = _price(record.get("hourly_cost"))
    if piece is not None:
        end = held_until if piece.end is None else piece.end
        return [*lost, MachineTime(piece.start, end, price, piece.projected)]
    released = _price(record.get("released_at"))
    end = released if released is not None else held_until
    return [*lost, MachineTime(float(record["asked_at"]), end, price)]


def shared_life(handle: RunHandle) -> MachineLife | None:
    """The life of the machine the run used in turn with others, if it did."""
    record = machine_record(handle)
    path = record.get("shared_machine") if record is not None else None
    return read_life(Path(path)) if isinstance(path, str) else None


def shared_piece(handle: RunHandle) -> Piece | None:
    life = shared_life(handle)
    return piece_of(life, handle.run_id) if life is not None else None


def run_cost(handle: RunHandle, *, held_until: float | None = None, now: float | None = None) -> float | None:
    """What the run cost (so far, for a machine still held); None when its
    price is not known or it never asked for a machine."""
    intervals = machine_intervals(handle, held_until=held_until)
    return cost_of(intervals, now) if intervals else None


def cap_of(handle: RunHandle) -> float | None:
    """The run's max_cost in USD, as pinned when it was launched; from the
    run's settings (where it is pinned too) when its machine record is
    damaged: a damaged record never lifts the cap."""
    record = machine_record(handle)
    cap = record.get("max_cost") if record is not None else handle.settings.get("max_cost")
    return float(cap) if _epoch(cap) and cap is not None else None


def usd(amount: float | None) -> str:
    """$0.0123 (a short run costs cents: four places show it), "-" for unknown."""
    if amount is None:
        return "-"
    return f"${amount:.2f}" if amount >= 100 else f"${amount:.4f}"


@dataclass(frozen=True)
class CapDeadline:
    """When a run's cost reaches its cap, as the machine keeps it: the
    worker's timeout ends the command then, with `message` as the reason."""

    at: float  # epoch seconds
    message: str


def cap_message(cap: float, hourly_cost: float) -> str:
    return (f"stopped: its cost reached max_cost = {usd(cap)} (at {usd(hourly_cost)}/h, machine time "
            "from launch included); raise max_cost (a setting of the backend, or remote_step(max_cost=...)) "
            "to let it run longer")  # fmt: skip


def damaged_cap_message(handle: RunHandle, cap: float, damage: str) -> str:
    return (f"stopped: its record of the machine time it spent is damaged ({damage}), so what it spent "
            f"against max_cost = {usd(cap)} is not known and its cap is taken as spent; "
            f"`doit {handle.step}` runs it anew, with a new record")  # fmt: skip


def cap_deadline(handle: RunHandle, now: float | None = None) -> CapDeadline | None:
    """The moment the run's cost so far reaches its cap, from the budget
    left now; None without a cap or on a machine that costs nothing."""
    cap = cap_of(handle)
    at = time.time() if now is None else now
    damage = machine_damage(handle)
    if cap is not None and damage is not None:  # what it spent is not known: its cap is taken as spent
        return CapDeadline(at, damaged_cap_message(handle, cap, damage))
    intervals = machine_intervals(handle)
    if cap is None or not intervals:
        return None
    spent = cost_of(intervals, at)
    price = intervals[-1].hourly_cost  # the machine held now
    if spent is None or not price:
        return None
    # A warm machine's keep-warm after the run is the run's to pay: kept back from its budget.
    life = shared_life(handle)
    ahead = life is not None and not any(i.projected for i in intervals)  # not counted in `spent` yet
    keep_warm = price * life.idle_seconds / 3600.0 if life is not None and ahead else 0.0
    left = max(0.0, cap - spent - keep_warm) / price * 3600.0
    return CapDeadline(at + left, cap_message(cap, price))


def worst_case(
    hourly_cost: float, timeout: float | None, lifetime: float | None, attempts: int = 1,
    keep_warm: float = 0.0,
) -> tuple[float, str] | None:
    """The most a run can cost before its cap: its price over its timeout,
    else over its machine's lifetime, and over the keep-warm after it (a
    warm machine's idle time, the last run's to pay); None when neither
    bounds it. `attempts`: 1 plus its preemptions. The timeout bounds the
    command's time summed over all attempts, so it counts once (each
    relaunch adds its machine's launch and setup, which no setting bounds:
    said, not guessed); a lifetime is each machine's own, so it counts per attempt."""
    warm = f" and its keep-warm of {clock_of(keep_warm)}" if keep_warm else ""
    if timeout is not None and math.isfinite(timeout):
        said = f"its timeout of {clock_of(timeout)}"
        if attempts > 1:
            said += f" over up to {attempts} attempts, plus each relaunch's launch"
        return hourly_cost * (timeout + keep_warm) / 3600.0, said + warm
    if lifetime is not None:
        said = f"its machine's lifetime of {clock_of(lifetime)}"
        if attempts > 1:
            said += f" for each of up to {attempts} attempts"
        return hourly_cost * (lifetime * attempts + keep_warm) / 3600.0, said + warm
    return None


def clock_of(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# After the worker's timeout at the cap, the run's lifetime timer is the
# backstop (a worker that died cannot stop its command): it fires once the
# worker has had its grace to stop the tree, and this much more.
CAP_BACKSTOP_SECONDS = 10.0


def watchdog_seconds(
    handle: RunHandle, lifetime: float, grace_seconds: float, now: float | None = None
) -> float:
    """The run's lifetime timer, armed now: its lifetime, or sooner when
    its cap comes first (the machine keeps the cap with no client)."""
    cap = cap_deadline(handle, now)
    if cap is None:
        return lifetime
    at = time.time() if now is None else now
    return min(lifetime, max(1.0, cap.at - at) + grace_seconds + CAP_BACKSTOP_SECONDS)
