"""A run's price and its cap, as the chain acts on them (store/cost.py
computes the figures).

Before a launch: the machine's hourly price (`hourly_cost`, else the
provider's catalog through the backend), said with the worst case; with a
cap and no price known, nothing launches. The moment the machine is asked
for is recorded before the paid call, so its time counts from there. After
the launch, a catalog price becomes the one of what was launched. When the
run ends at its cap, the verdict says so; when its machine is let go, the
time and cost are recorded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from substrax_tasks.console import emit
from substrax_tasks.errors import SubstraxError
from substrax_tasks.store import cost

if TYPE_CHECKING:
    from substrax_tasks.backends.base import Backend, RunStatus
    from substrax_tasks.run.driven_run import DrivenRun
    from substrax_tasks.store.handle import RunHandle
    from substrax_tasks.store.run_store import RunStore


def priced(backend: Backend, handle: RunHandle) -> tuple[float | None, str | None]:
    """The run's hourly price and where it comes from: its machine's at
    `hourly_cost` when set (it overrides the catalog), else at the
    backend's catalog price; times the share of the machine the run holds."""
    setting = getattr(backend.settings, "hourly_cost", None)
    price: float | None
    source: str | None
    if isinstance(setting, (int, float)):
        price, source = float(setting), "hourly_cost"
    else:
        price = backend.hourly_price(handle)
        source = "catalog" if price else None  # 0: this machine, which costs nothing
    return (None if price is None else price * backend.machine_share(handle)), source


def before_launch(
    run: DrivenRun, backend: Backend, handle: RunHandle, *, attempts: int = 1
) -> tuple[RunHandle, dict[str, Any] | None]:
    """Price the run, say it and its worst case, refuse a cap that cannot
    be kept (no price known), and record the machine as asked for now;
    one that costs nothing (this machine) and has no cap is returned
    instead, to be recorded with the launch in the same write (a local
    step's overhead is its handle's writes). `attempts`: 1 plus the step's
    preemptions, for the worst case."""
    cap = getattr(backend.settings, "max_cost", None)
    cap = float(cap) if isinstance(cap, (int, float)) else None
    price, source = priced(backend, handle)
    if price is None and cap is not None:
        message = (f"max_cost = {cost.usd(cap)} cannot be kept: the price of the {backend.name} backend's "
                   "machine is not known (no catalog prices it); set hourly_cost (USD an hour) in "
                   f"[tool.substrax.compute.backends.{backend.name}] so its cost can be counted. "
                   "Nothing was launched")  # fmt: skip
        run.save(handle, verdict={"state": "failed", "message": message})
        raise SubstraxError(message)
    machine = {"asked_at": time.time(), "released_at": None, "hourly_cost": price, "price_from": source,
               "max_cost": cap}  # fmt: skip
    if price == 0.0 and cap is None:
        return handle, machine
    if price is not None:
        emit(price_line(handle, backend, price, source, cap, attempts=attempts))
    return run.save(handle, machine=machine), None


def price_line(
    handle: RunHandle, backend: Backend, price: float, source: str | None, cap: float | None,
    *, attempts: int = 1,
) -> str:
    """`train: $3.0600/h on skypilot; at most $18.3600 over its timeout of
    6:00:00; stopped at max_cost = $40.0000`"""
    said = f"{handle.step}: {cost.usd(price)}/h on {backend.name}"
    if source == "hourly_cost":
        said += " (hourly_cost)"
    worst = cost.worst_case(price, handle.spec.timeout, backend.lifetime_seconds(), attempts,
                            backend.keep_warm_seconds(handle))  # fmt: skip
    if worst is not None:
        said += f"; at most {cost.usd(worst[0])} over {worst[1]}"
    if cap is not None:
        said += f"; stopped at max_cost = {cost.usd(cap)}"
    return said


def after_launch(run: DrivenRun, backend: Backend, handle: RunHandle) -> RunHandle:
    """Unless `hourly_cost` set it, the price is now the catalog's for what
    was launched (the provider may have chosen another instance than the
    estimate's, or the estimate knew none before its optimizer chose)."""
    record = cost.machine_record(handle)
    if record is None:
        return handle
    record = shared_machine(backend, handle, record)
    if record.get("price_from") != "hourly_cost":
        launched = backend.hourly_price(handle)
        price = None if not launched else launched * backend.machine_share(handle)
        if price is not None and price != record.get("hourly_cost"):
            emit(price_line(handle, backend, price, "catalog", cost.cap_of(handle)) + " (as launched)")
            record = {**record, "hourly_cost": price, "price_from": "catalog"}
    return handle if record == cost.machine_record(handle) else run.save(handle, machine=record)


def shared_machine(backend: Backend, handle: RunHandle, record: dict[str, Any]) -> dict[str, Any]:
    """On a machine runs use in turn (a warm cluster), the run's machine
    time is its piece of the machine's life: the record names that life."""
    life = backend.shared_machine(handle)
    return record if life is None else {**record, "shared_machine": str(life)}


def before_relaunch(run: DrivenRun, handle: RunHandle) -> RunHandle:
    """The lost attempt's machine ends now, when it was found lost; the
    new attempt's is asked for now, at the same price until `after_launch`
    reads the price of what was relaunched. Its cap is the run's: what
    the earlier attempts spent is gone from it (store/cost.py)."""
    record = cost.machine_record(handle)
    if record is None or (record.get("hourly_cost") == 0.0 and cost.cap_of(handle) is None):
        return handle  # a free machine: its time is its command's
    return run.save(handle, machine=cost.relaunched_record(record, time.time(), record.get("hourly_cost")))


def budget_spent(handle: RunHandle) -> str | None:
    """Why a lost run is not relaunched for its cap: what its attempts
    spent leaves no second of machine time at its price; None: it can be."""
    cap = cost.cap_of(handle)
    damage = cost.machine_damage(handle)
    if cap is not None and damage is not None:  # what it spent is not known: its cap is taken as spent
        return (f"its record of the machine time it spent is damaged ({damage}), so what it spent against "
                f"max_cost = {cost.usd(cap)} is not known and it is not relaunched; run doit again to run "
                "it anew, with a new record")  # fmt: skip
    intervals = cost.machine_intervals(handle)
    if cap is None or not intervals:
        return None
    now = time.time()
    spent, price = cost.cost_of(intervals, now), intervals[-1].hourly_cost
    if spent is None or not price or (cap - spent) / price * 3600.0 >= 1.0:
        return None
    return (f"its max_cost = {cost.usd(cap)} is spent ({cost.usd(spent)} over its {len(intervals)} "
            "attempt(s), machine time from each launch included), so it is not relaunched; raise "
            "max_cost (a setting of the backend, or remote_step(max_cost=...)) and run doit again "
            "to run it anew")  # fmt: skip


def stopped_at_cap(handle: RunHandle, status: RunStatus) -> str | None:
    """The message of a run its worker stopped at the cap, else None."""
    if status.state != "timed_out" or cost.cap_of(handle) is None:
        return None
    message = status.message or ""
    return message if "max_cost" in message else None


def record_release(store: RunStore, handle: RunHandle) -> None:
    """The run's machine was let go now: its time ends, its cost is kept.
    `handle` as read before the teardown (which changes none of the core's
    state): the write merges with the one on disk."""
    record = cost.machine_record(handle)
    if record is None or isinstance(record.get("released_at"), (int, float)):
        return
    if record.get("hourly_cost") == 0.0:  # a free machine's time is its command's (status reads it so)
        return
    now = time.time()
    store.update_state(handle, machine={**record, "released_at": now},
                       cost_usd=cost.run_cost(handle, held_until=now, now=now))  # fmt: skip
