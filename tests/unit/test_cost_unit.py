"""A run's cost from its machine intervals, and its cap turned into the
deadlines the machine keeps (store/cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from substrax_tasks.backends.local.settings import LocalSettings
from substrax_tasks.backends.skypilot.backend import SkypilotBackend
from substrax_tasks.backends.skypilot.settings import SkypilotSettings
from substrax_tasks.errors import SpecError
from substrax_tasks.run.spending import priced
from substrax_tasks.step.args import max_cost_of
from substrax_tasks.step.spec import StepSpec
from substrax_tasks.store import cost
from substrax_tasks.store.cost import MachineTime
from substrax_tasks.store.handle import CoreState, RunHandle
from substrax_tasks.store.run_store import RunStore


def handle_with(machine: dict[str, Any] | None) -> RunHandle:
    return RunHandle(
        run_id="r", step="s", backend="ssh", settings={}, spec=StepSpec(step="s", command=["true"]),
        spec_digest="d", created_at="2026-01-01T00:00:00+00:00", state=CoreState(machine=machine),
    )  # fmt: skip


@pytest.mark.unit
def test_a_cost_sums_every_interval_at_its_own_price() -> None:
    # Two attempts: an hour at $2/h, then half an hour at $3/h still held at `now`.
    intervals = [MachineTime(0.0, 3600.0, 2.0), MachineTime(4000.0, None, 3.0)]
    assert cost.cost_of(intervals, now=4000.0 + 1800) == pytest.approx(2.0 + 1.5)
    assert cost.machine_seconds(intervals, now=5800.0) == pytest.approx(5400.0)


@pytest.mark.unit
def test_a_relaunched_runs_machines_are_one_interval_per_attempt_at_its_own_price() -> None:
    # Launched at 0 on spot at $36/h, found lost at 100; relaunched on demand at $72/h, let go at 150.
    first = {"asked_at": 0.0, "released_at": None, "hourly_cost": 36.0, "max_cost": 4.0}
    relaunched = cost.relaunched_record(first, 100.0, 72.0)
    assert relaunched["earlier"] == [{"asked_at": 0.0, "released_at": 100.0, "hourly_cost": 36.0}]
    handle = handle_with({**relaunched, "released_at": 150.0})
    assert cost.machine_intervals(handle) == [MachineTime(0.0, 100.0, 36.0), MachineTime(100.0, 150.0, 72.0)]
    assert cost.run_cost(handle) == pytest.approx(1.0 + 1.0)
    # The cap is the run's: at 120 the attempts spent $1.40 of $4, which lasts 130 s more at $72/h.
    deadline = cost.cap_deadline(handle_with(relaunched), now=120.0)
    assert deadline is not None and deadline.at == pytest.approx(120.0 + 130.0)
    # A third attempt keeps both earlier machines.
    third = cost.relaunched_record(relaunched, 200.0, 36.0)
    assert [m["released_at"] for m in third["earlier"]] == [100.0, 200.0]


@pytest.mark.unit
def test_an_interval_of_unknown_price_makes_the_cost_unknown_not_partial() -> None:
    assert cost.cost_of([MachineTime(0.0, 3600.0, 2.0), MachineTime(0.0, 10.0, None)], now=0.0) is None
    assert cost.usd(None) == "-"
    assert cost.usd(0.012345) == "$0.0123"


@pytest.mark.unit
def test_a_released_machine_stops_counting_and_one_held_counts_to_now() -> None:
    released = handle_with({"asked_at": 100.0, "released_at": 460.0, "hourly_cost": 10.0, "max_cost": None})
    assert cost.run_cost(released, now=10_000.0) == pytest.approx(1.0)
    held = handle_with({"asked_at": 100.0, "released_at": None, "hourly_cost": 10.0, "max_cost": None})
    assert cost.run_cost(held, now=460.0) == pytest.approx(1.0)
    assert cost.run_cost(held, held_until=280.0, now=10_000.0) == pytest.approx(0.5)
    assert cost.run_cost(handle_with(None)) is None


@pytest.mark.unit
def test_the_budget_left_becomes_the_workers_deadline_and_the_lifetime_timers() -> None:
    # $36/h is a cent a second: a cap of $1 from t=1000 is reached at t=1100.
    capped = handle_with({"asked_at": 1000.0, "released_at": None, "hourly_cost": 36.0, "max_cost": 1.0})
    deadline = cost.cap_deadline(capped, now=1040.0)
    assert deadline is not None
    assert deadline.at == pytest.approx(1100.0)
    assert "max_cost = $1.0000" in deadline.message
    # The lifetime timer fires after the worker's grace past the cap, or at its lifetime if sooner.
    assert cost.watchdog_seconds(capped, 7200.0, 5.0, now=1040.0) == pytest.approx(60 + 5 + 10)
    assert cost.watchdog_seconds(capped, 30.0, 5.0, now=1040.0) == 30.0
    # No cap, or a machine that costs nothing: no deadline.
    free = handle_with({"asked_at": 1000.0, "released_at": None, "hourly_cost": 0.0, "max_cost": 1.0})
    assert cost.cap_deadline(free, now=1040.0) is None
    uncapped = handle_with({"asked_at": 1000.0, "released_at": None, "hourly_cost": 36.0, "max_cost": None})
    assert cost.cap_deadline(uncapped, now=1040.0) is None
    assert cost.watchdog_seconds(uncapped, 7200.0, 5.0, now=1040.0) == 7200.0


@pytest.mark.unit
def test_the_worst_case_is_the_price_over_the_timeout_else_the_lifetime() -> None:
    assert cost.worst_case(3.0, 1800.0, 7200.0) == (1.5, "its timeout of 30:00")
    assert cost.worst_case(3.0, None, 7200.0) == (6.0, "its machine's lifetime of 2:00:00")
    assert cost.worst_case(3.0, None, None) is None
    # Over three attempts: the timeout bounds the command's time over them all; a lifetime is each machine's.
    assert cost.worst_case(3.0, 1800.0, 7200.0, 3) == (
        1.5, "its timeout of 30:00 over up to 3 attempts, plus each relaunch's launch")
    assert cost.worst_case(3.0, None, 7200.0, 3) == (
        18.0, "its machine's lifetime of 2:00:00 for each of up to 3 attempts")


@pytest.mark.unit
@pytest.mark.parametrize("bad", [0, -1.5, float("inf"), float("nan"), True, "5", [5]])
def test_remote_steps_max_cost_is_a_positive_number_of_dollars(bad: object) -> None:
    with pytest.raises(SpecError) as caught:
        max_cost_of("train", bad)
    said = str(caught.value)
    assert said.startswith("step 'train': max_cost must be a positive number of US dollars, got "), said
    assert "write max_cost=5.0" in said
    assert max_cost_of("train", None) is None
    assert max_cost_of("train", 5) == 5.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("key", "bad"),
    [("hourly_cost", -0.5), ("max_cost", 0.0), ("max_cost", float("inf")), ("hourly_cost", "1.2")],
)
def test_the_cost_settings_refuse_what_is_no_price_or_cap(key: str, bad: object) -> None:
    with pytest.raises(ValidationError) as caught:
        LocalSettings.model_validate({key: bad})
    assert caught.value.errors()[0]["loc"] == (key,)
    assert LocalSettings.model_validate({"hourly_cost": 0, "max_cost": 2}).max_cost == 2.0


@pytest.mark.unit
def test_a_step_on_a_shared_out_warm_cluster_is_charged_its_seats_share(tmp_path: Path) -> None:
    """`accelerators = "A100:2"` with reuse, a step asking for "A100:1":
    two steps side by side on one cluster, each charged half its price."""
    settings = SkypilotSettings.model_validate({
        "reuse": True, "accelerators": "A100:2", "hourly_cost": 4.0, "copy": {"lifetime_minutes": 60.0},
    })  # fmt: skip
    backend = SkypilotBackend(settings, RunStore(tmp_path))
    spec = StepSpec(step="fit", command=["true"], resources={"accelerators": "A100:1"})
    one_seat = handle_with(None).model_copy(update={"spec": spec})
    assert backend.machine_share(one_seat) == 0.5
    assert priced(backend, one_seat) == (2.0, "hourly_cost")
    whole = handle_with(None).model_copy(update={"spec": StepSpec(step="fit", command=["true"])})
    assert priced(backend, whole) == (4.0, "hourly_cost")  # asks for no GPU of it: the whole cluster
