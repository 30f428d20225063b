"""A run's durable phase (store/phase.py): one order, only forward, a refetch
its own phase; recorded by the chain through RunStore.advance, which checks
the move against the phase on disk, and by no backend. And the one list of
final states, the worker's and the client's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from substrax_tasks._remote import control
from substrax_tasks.backends.base import ENDED_BY_ITS_WORKER, FINAL_STATES
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.phase import Phase, PhaseError, moved_to, progress, reached
from substrax_tasks.store.run_store import RunStore

pytestmark = pytest.mark.unit

CHAIN = [Phase.LAUNCHED, Phase.SET_UP, Phase.SYNCED, Phase.STARTED, Phase.FETCHED, Phase.PROMOTED]


def test_the_phases_in_the_order_the_chain_reaches_them_with_the_values_handles_hold() -> None:
    assert [p.value for p in Phase] == [
        "created", "launched", "set_up", "synced", "started", "refetch", "fetched", "promoted",
    ]  # fmt: skip
    assert [p.position for p in Phase] == list(range(len(Phase)))
    assert Phase.STARTED.reached(Phase.LAUNCHED) and Phase.STARTED.reached(Phase.STARTED)
    assert not Phase.LAUNCHED.reached(Phase.STARTED)
    # A refetch has started (never started again) and is not promoted (kept until home).
    assert Phase.REFETCH.reached(Phase.STARTED) and not Phase.REFETCH.reached(Phase.FETCHED)


def test_a_handle_written_before_the_enum_reads_the_same_and_an_unknown_phase_as_none() -> None:
    assert Phase.of({"phase": "started"}) is Phase.STARTED
    assert Phase.of({"phase": "started"}) == "started"  # str-valued: the JSON on disk is unchanged
    assert Phase.of({}) is None and Phase.of({"phase": "dreaming"}) is None and Phase.of({"phase": 3}) is None
    assert not reached({}, Phase.CREATED) and reached({"phase": "synced"}, Phase.SET_UP)


def test_the_chain_and_two_refetches_only_ever_move_forward() -> None:
    state: dict[str, object] = {"phase": "created"}
    seen = [progress(state)]
    for phase in CHAIN + [Phase.REFETCH, Phase.FETCHED, Phase.PROMOTED] * 2:
        state.update(moved_to(state, phase, "r1"))
        seen.append(progress(state))
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert state == {"phase": "promoted", "refetches": 2}


def test_a_backward_move_is_refused_and_a_phase_recorded_again_is_no_move() -> None:
    with pytest.raises(PhaseError, match="run r1: its phase cannot go back from promoted to started"):
        moved_to({"phase": "promoted"}, Phase.STARTED, "r1")
    with pytest.raises(PhaseError, match="cannot go back from synced to launched"):
        moved_to({"phase": "synced"}, Phase.LAUNCHED, "r1")
    assert moved_to({"phase": "fetched"}, Phase.FETCHED, "r1") == {"phase": "fetched"}  # fetched again
    # Only a promoted run is fetched again: a refetch is entered from nowhere else.
    for before in ("started", "fetched", "refetch"):
        with pytest.raises(PhaseError, match=f"only a promoted run is fetched again \\(it is {before}\\)"):
            moved_to({"phase": before}, Phase.REFETCH, "r1")


def test_the_store_checks_the_move_against_the_phase_on_disk_and_update_state_writes_none(
    tmp_path: Path,
) -> None:
    store = RunStore(tmp_path / ".substrax")
    created = store.new_run(make_spec("s", ["true"], tmp_path), "local", {})
    assert created.state.phase is Phase.CREATED
    promoted = created
    for phase in CHAIN:
        promoted = store.advance(promoted, phase)
    # A stale copy (read before the promotion) cannot take the run back.
    with pytest.raises(PhaseError, match="cannot go back from promoted to started"):
        store.advance(created, Phase.STARTED)
    with pytest.raises(ValueError, match=r"its phase is recorded by RunStore\.advance alone"):
        store.update_state(promoted, phase="started")  # as a backend once did
    on_disk = json.loads(store.handle_path(created.run_id).read_text())["state"]
    assert on_disk["phase"] == "promoted"
    store.advance(created, Phase.REFETCH)  # the stale copy's state is merged under the disk's
    again = store.read(created.run_id).state
    assert again.phase is Phase.REFETCH and again.refetches == 1


def test_the_clients_final_states_are_the_workers_and_lost() -> None:
    """remote/control.py runs on hosts and imports nothing of the package:
    the client's list is checked against the very file the worker runs."""
    assert frozenset(control.FINAL_STATES) == ENDED_BY_ITS_WORKER
    assert ENDED_BY_ITS_WORKER | {"lost"} == FINAL_STATES
    assert [s for s in control.STATES if s not in FINAL_STATES] == ["starting", "running"]
