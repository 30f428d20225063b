"""Which earlier run of a step a launch picks up: one still going
(reattach), one finished but not yet fetched or whose outputs changed here
(fetch again); one lost or never launched is recorded given up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from substrax_tasks.console import emit
from substrax_tasks.errors import HandleError, SubstraxError
from substrax_tasks.store.phase import Phase
from substrax_tasks.store.run_store import SET_ASIDE
from substrax_tasks.uptodate import check as uptodate

if TYPE_CHECKING:
    from substrax_tasks.backends.base import RunStatus
    from substrax_tasks.run.driven_run import DrivenRun
    from substrax_tasks.store.handle import RunHandle

# How a run ends that leaves its step to do: a new run starts from its checkpoints.
ENDED_UNDONE = ("failed", "timed_out", "cancelled")


def last_run(driver: DrivenRun) -> RunHandle | None:
    """The step's last run. A damaged step record or handle is moved aside
    when the run it may name is provably over; otherwise it is an error
    (that run may be going on: a second must not start beside it)."""
    store = driver.project.store
    try:
        record = uptodate.read_record(driver.step, strict=True)
    except SubstraxError:
        if not no_run_going(driver):
            raise
        set_aside(driver, driver.step.files.record, "its record", "no run of it is going")
        return None
    run_id = record.get("run_id")
    if not run_id:
        return None
    if not store.handle_path(str(run_id)).exists():
        return None  # its folder was removed: nothing runs there any more
    try:
        handle = store.read(str(run_id))
    except HandleError as exc:
        if not ended_by_its_worker(store.run_dir(str(run_id))):
            raise HandleError(
                f"the handle of its last run is damaged ({exc}), and that run may still be going. "
                f"Stop it if it is (its worker's pid is in {store.run_dir(str(run_id))}/status.json), "
                "then remove that folder and run again"
            ) from None
        set_aside(driver, store.handle_path(str(run_id)), f"the handle of its last run {run_id}",
                  "its worker recorded how the run ended")  # fmt: skip
        return None
    if not store.owns(handle):
        # Copied with this state folder: the original's to reattach, fetch
        # or stop, never this copy's (store/client.py).
        emit(f"{driver.spec.step}: its last run {run_id} was launched from the project this one is a copy "
             "of; it stays that project's, and this one runs the step itself")  # fmt: skip
        return None
    return handle


def ended_by_its_worker(run_dir: Path) -> bool:
    """The run's worker wrote its final status here (the local backend's;
    a remote run's is on its host, out of reach without its handle)."""
    # Not on a no-op's path: the driver is imported by every doit, this only by a launch.
    from substrax_tasks._remote import control
    from substrax_tasks.backends.base import ENDED_BY_ITS_WORKER

    record = control.read_json(str(run_dir / "status.json"))
    return isinstance(record, dict) and record.get("state") in ENDED_BY_ITS_WORKER


def no_run_going(driver: DrivenRun) -> bool:
    """No run of the step can be going: each readable handle of it says its
    run ended (a lost one only once what it left was stopped), and each
    unreadable one (whose step cannot be known) has its worker's final
    status beside it."""
    handles, unreadable = driver.project.store.read_all()
    for handle in handles:
        if handle.step != driver.spec.step or not driver.project.store.owns(handle):
            continue
        try:
            status = driver.backend(handle).status(handle)
        except SubstraxError:  # its host out of reach: not proved
            return False
        # lost, and not yet judged (stop_lost records it once what was left is stopped): its tree may run on
        if not status.final or (status.state == "lost" and not handle.state.verdict):
            return False
    return all(ended_by_its_worker(record.path.parent) for record in unreadable)


def set_aside(driver: DrivenRun, path: Path, what: str, proof: str) -> None:
    """Keep a damaged record under a name of its own beside it, and say so:
    what it said cannot be read, and the run it names is over."""
    aside = path.with_name(f"{path.name}{SET_ASIDE}{time.strftime('%Y%m%dT%H%M%S')}")
    path.replace(aside)
    emit(f"{driver.spec.step}: {what} was damaged and {proof}: moved aside to {aside}; going on")


def retire_unlaunched(driver: DrivenRun) -> None:
    """The step's previous run, if its launch never succeeded, would read
    `pending` for ever: record that it was given up."""
    old = last_run(driver)
    never_launched = old is not None and not old.state.reached(Phase.LAUNCHED)
    if old is not None and never_launched and not old.state.verdict:
        driver.save(old, verdict={"state": "failed", "message": "never launched; a newer run replaced it"})


def stop_lost(driver: DrivenRun, handle: RunHandle, said: str) -> None:
    """A run whose worker died without ending it (killed by the OOM killer,
    say) may have left its command running: that tree is stopped (the
    backend's cancel, control.py's on every backend: found by its cgroup,
    the mark its processes carry, its session) before a new run of the
    step starts, which would otherwise run beside it and take its GPUs.
    Then the run is recorded lost: status and later reruns read it as
    given up. Raises, launching nothing, if the tree could not be stopped."""
    from substrax_tasks.errors import BackendError

    backend = driver.backend(handle)
    try:
        backend.cancel(handle)
    except BackendError as exc:
        raise BackendError(
            f"run {handle.run_id} was lost ({said}) and what is left of it could not be stopped ({exc}); "
            f"a new run would start beside it. Stop it (`substrax-compute cancel {handle.run_id}`), "
            "then run again"
        ) from None
    driver.save(handle, verdict={"state": "lost", "message": said})
    emit(f"{driver.spec.step}: run {handle.run_id} was lost ({said}); stopped what was left of it; "
         "launching a new run")


def earlier_status(driver: DrivenRun, handle: RunHandle, same_key: bool) -> RunStatus | None:
    """The status of the step's last run, what is left of it stopped if it
    was lost. None: a run of other inputs or settings whose machine cannot
    be asked (it may be gone for good); for a run of today's key that is an
    error, as it may be going on."""
    try:
        status = driver.backend(handle).poll(handle)
    except SubstraxError as exc:
        if same_key:
            raise
        emit(f"{driver.spec.step}: the state of its earlier run {handle.run_id} is unknown ({exc})")
        return None
    if status.state == "lost":
        stop_lost(driver, handle, status.message or "its worker or machine is gone")
    return status


def reusable_run(driver: DrivenRun, key: str) -> RunHandle | None:
    """The step's last run, if it has today's key and is worth keeping:
    still going (reattach), or finished but not yet fetched. A lost run,
    whatever its key, has what is left of it stopped first."""
    handle = last_run(driver)
    if handle is None or handle.state.verdict:
        return None
    same_key = handle.state.key == key
    status = earlier_status(driver, handle, same_key)
    undone = status is not None and status.state in ENDED_UNDONE
    if same_key and undone and driver.spec.checkpoints is not None:
        # It ended with no client following it (one would have kept them as
        # it ended): what it left there is what the new run starts from.
        driver.backend(handle).keep_last_checkpoints(handle)
    if status is None or not same_key or (status.final and status.state != "succeeded"):
        return None
    backend = driver.backend(handle)
    if not status.final:
        emit(f"{driver.spec.step}: reattaching to run {handle.run_id} ({status.state})")
        return handle
    if handle.state.phase is not Phase.PROMOTED:
        emit(f"{driver.spec.step}: run {handle.run_id} finished; fetching its outputs again")
        return handle
    if not driver.check_held and backend.outputs_available(handle):  # else asked for a real run
        emit(f"{driver.spec.step}: outputs changed here; fetching run {handle.run_id} again")
        return driver.advance(handle, Phase.REFETCH)
    return None
