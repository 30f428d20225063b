"""A warm cluster's life cut into one piece per run that used it, with no
gap and no overlap, and what each run is charged from it (store/shared_machine.py,
store/cost.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrax_tasks.step.spec import StepSpec
from substrax_tasks.store import cost, shared_machine
from substrax_tasks.store.handle import CoreState, RunHandle
from substrax_tasks.store.shared_machine import Claim, MachineLife, Piece, piece_of

IDLE = 300.0  # the lease's keep-warm: idle_minutes = 5


def life(
    *claims: Claim, released: dict[str, float] | None = None, down_at: float | None = None
) -> MachineLife:
    return MachineLife("c", claims[0].at, IDLE, claims, released or {}, down_at)


def handle_on(
    path: Path, run_id: str, asked_at: float, price: float = 3.6, cap: float | None = None
) -> RunHandle:
    machine = {"asked_at": asked_at, "released_at": None, "hourly_cost": price, "price_from": "catalog",
               "max_cost": cap, "shared_machine": str(path)}  # fmt: skip
    return RunHandle(
        run_id=run_id, step="s", backend="skypilot", settings={}, spec=StepSpec(step="s", command=["true"]),
        spec_digest="d", created_at="2026-01-01T00:00:00+00:00", state=CoreState(machine=machine),
    )  # fmt: skip


@pytest.mark.unit
def test_runs_in_turn_each_pay_from_their_claim_to_the_next_and_the_last_to_the_cluster_going() -> None:
    # a launches at 0 (provisioning, setup: its piece), ends at 100; b claims at 400, c at 900.
    used = life(Claim("a", 0.0, 0), Claim("b", 400.0, 0), Claim("c", 900.0, 0),
                released={"a": 100.0, "b": 500.0, "c": 1000.0}, down_at=1234.0)  # fmt: skip
    pieces = [piece_of(used, r) for r in "abc"]
    assert pieces == [Piece(0.0, 400.0, False), Piece(400.0, 900.0, False), Piece(900.0, 1234.0, False)]
    # No gap, no overlap: together they are the cluster's whole life.
    assert sum((p.end or 0) - p.start for p in pieces if p) == pytest.approx(1234.0)
    assert piece_of(used, "never") is None


@pytest.mark.unit
def test_the_last_runs_piece_is_projected_to_its_keep_warm_until_the_cluster_is_seen_gone() -> None:
    used = life(Claim("a", 0.0, 0), Claim("b", 400.0, 0), released={"a": 100.0})
    assert piece_of(used, "b") == Piece(400.0, None, False)  # b holds it still: counted to now
    done = life(Claim("a", 0.0, 0), Claim("b", 400.0, 0), released={"a": 100.0, "b": 500.0})
    assert piece_of(done, "b") == Piece(400.0, 500.0 + IDLE, True)
    gone = MachineLife("c", 0.0, IDLE, done.claims, done.released, 650.0)
    assert piece_of(gone, "b") == Piece(400.0, 650.0, False)


@pytest.mark.unit
def test_seats_side_by_side_each_cut_their_own_turns() -> None:
    # Two seats (A100:2 shared out as A100:1): a and b side by side, then c after a in seat 0.
    used = life(Claim("a", 0.0, 0), Claim("b", 10.0, 1), Claim("c", 200.0, 0),
                released={"a": 150.0, "b": 300.0, "c": 400.0}, down_at=1000.0)  # fmt: skip
    assert piece_of(used, "a") == Piece(0.0, 200.0, False)
    assert piece_of(used, "b") == Piece(0.0, 1000.0, False)  # first in its seat: from the launch
    assert piece_of(used, "c") == Piece(200.0, 1000.0, False)


@pytest.mark.unit
def test_a_runs_cost_and_cap_read_its_piece_of_the_life_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    shared_machine.launched(path, "c", IDLE, Claim("a", 0.0, 0))
    shared_machine.claimed(path, "b", 3600.0, 0)
    shared_machine.released(path, "a", 100.0)
    first, last = handle_on(path, "a", 0.0), handle_on(path, "b", 3600.0, cap=10.0)
    assert cost.run_cost(first, now=99999.0) == pytest.approx(3.6)  # launch to b's claim, at $3.6/h
    # b runs: its cap keeps its keep-warm back ($10 - $3.6 spent - $0.30 of keep-warm).
    deadline = cost.cap_deadline(last, now=7200.0)
    assert deadline is not None and deadline.at == pytest.approx(7200.0 + (10.0 - 3.6 - 0.3) / 3.6 * 3600)
    shared_machine.released(path, "b", 7200.0)
    [projected] = cost.machine_intervals(last)
    assert projected.projected and projected.end == pytest.approx(7200.0 + IDLE)
    assert cost.run_cost(last) == pytest.approx(3.9)  # its keep-warm counted once, not kept back again
    deadline = cost.cap_deadline(last, now=7200.0)
    assert deadline is not None and deadline.at == pytest.approx(7200.0 + (10.0 - 3.9) / 3.6 * 3600)
    shared_machine.went_down(path, 7300.0)
    [exact] = cost.machine_intervals(last)
    assert not exact.projected and exact.end == pytest.approx(7300.0)
    shared_machine.went_down(path, 9000.0)  # seen again: the first end stands
    assert cost.run_cost(last) == pytest.approx(3.7)


@pytest.mark.unit
def test_a_cluster_seen_gone_went_at_the_latest_when_its_keep_warm_ended(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    shared_machine.launched(path, "c", IDLE, Claim("a", 0.0, 0))
    shared_machine.released(path, "a", 100.0)
    shared_machine.went_down(path, 5000.0, seen=True)
    assert piece_of(shared_machine.read_life(path) or life(Claim("x", 0, 0)), "a") == Piece(0.0, 400.0, False)


@pytest.mark.unit
def test_the_worst_case_on_a_warm_cluster_adds_its_keep_warm() -> None:
    worst = cost.worst_case(3.6, 3600.0, None, keep_warm=IDLE)
    assert worst is not None and worst[0] == pytest.approx(3.9)
    assert worst[1] == "its timeout of 1:00:00 and its keep-warm of 5:00"
