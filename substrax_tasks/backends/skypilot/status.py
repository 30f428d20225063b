"""How a SkyPilot run's status is read: the worker's own record first, over
the cluster's ssh (a fraction of a second); SkyPilot's queue (a helper
process that imports `sky`: seconds of CPU per read) when that record is
silent (the job is queued, or failed before its worker started) or says the
run ended, read once then: SkyPilot's final verdict stands where the
worker's disagrees, and a queue that still says running (it lags the
worker by seconds) does not hold the end up. The launch request's status
before there is a job. The final status is kept in the handle: a cluster
taken down says nothing.

While the worker's record says the run goes, the wait is one follower of
its log (_remote_run.follow_log), which ends with the run; its status is
read once then.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from substrax_tasks.backends.base import FINAL_STATES, RunStatus
from substrax_tasks.backends.job import status_from_record
from substrax_tasks.backends.skypilot.client import CLUSTER_GONE, REQUEST_LIVE, SkyCallError, job_state
from substrax_tasks.errors import SubstraxError
from substrax_tasks.store.handle import RunHandle

if TYPE_CHECKING:
    from substrax_tasks.backends.skypilot.backend import SkypilotBackend

# The message of a run the worker's record says goes: its worker has
# started, so SkyPilot no longer holds the job in its queue.
WORKER_RUNNING = "RUNNING (the worker's record)"


def poll(backend: SkypilotBackend, handle: RunHandle) -> RunStatus:
    """The run's status; `worker_started` says whether it is read from the
    worker's record of a run going."""
    ended = _kept(backend, handle)
    if ended is not None:
        return ended
    job_id = handle.state.get("job_id")
    if not isinstance(job_id, int):
        return _launch_status(backend, handle)
    record = worker_record(backend, handle)
    if record is not None and record.get("worker_alive") and record.get("state") in ("starting", "running"):
        return RunStatus("running", started_at=record.get("started_at"), message=WORKER_RUNNING)
    cluster = backend.cluster(handle)
    try:
        answer = backend.sky().call("job_status", {"cluster_name": cluster, "job_ids": [job_id]})
    except SkyCallError as exc:
        return _after_error(backend, handle, exc)
    status = _from_queue(answer, job_id, cluster)
    if status.state == "running" and record is not None and record.get("state") in FINAL_STATES:
        # SkyPilot's queue says so once its job's driver has seen the job
        # script exit, seconds later; the worker wrote its end after its
        # outputs' manifest, and the script exits with the worker's code.
        status = RunStatus(
            str(record["state"]), message=f"the worker's record (SkyPilot job {status.message})"
        )
    if not status.final or status.state == "lost":
        return status
    # a record that says the run ended holds still; another is read again
    final_record = record if record is not None and record.get("state") in FINAL_STATES else None
    status = _from_worker(backend, handle, status, final_record)
    if "slot" in handle.state:  # kept now: another run's teardown may take the shared cluster down
        with contextlib.suppress(SubstraxError, OSError):
            backend.remote_run(handle).keep_log(backend.run_file(handle, "run.log"))
    backend.store.update_state(handle, final_status=status.__dict__)
    return status


def worker_started(status: RunStatus) -> bool:
    """Whether poll() read the run going from its worker's record (not from
    SkyPilot's queue, where a job may still wait, and may be cancelled)."""
    return status.state == "running" and status.message == WORKER_RUNNING


def _from_queue(answer: Any, job_id: int, cluster: str) -> RunStatus:
    """The job's status in SkyPilot's queue, from job_status's answer."""
    value = (answer or {}).get(str(job_id))
    if value is None:
        return RunStatus("lost", message=f"job {job_id} is not in the queue of {cluster}")
    state = job_state(value)
    return RunStatus(state, message=str(value) if state == "running" else f"SkyPilot job {value}")


def _kept(backend: SkypilotBackend, handle: RunHandle) -> RunStatus | None:
    """The final status kept in the handle. A caller's copy may predate the
    end: once the cluster is down, the store's record is all that tells it."""
    cached = handle.state.get("final_status")
    if not isinstance(cached, dict):
        with contextlib.suppress(SubstraxError):
            cached = backend.store.read(handle.run_id).state.get("final_status")
    return RunStatus(**cached) if isinstance(cached, dict) else None


def worker_record(backend: SkypilotBackend, handle: RunHandle) -> dict[str, Any] | None:
    """The worker's status record on the cluster (remote/control.py's), or
    None while there is none or the cluster is out of reach."""
    try:
        record = backend.remote_run(handle).status()
    except SubstraxError:
        return None
    return record if record.get("state") else None


def _after_error(backend: SkypilotBackend, handle: RunHandle, exc: SkyCallError) -> RunStatus:
    """SkyPilot could not read the job's status. While another process
    cancels the run, its cluster is going: SkyPilot then fails in ways
    of its own (on Slurm, a CommandError once the cluster's runtime is
    removed), which say nothing about the run; the canceller's record
    tells the end."""
    with contextlib.suppress(SubstraxError):
        handle = backend.store.read(handle.run_id)
    final = handle.state.get("final_status")
    if isinstance(final, dict):
        return RunStatus(**final)
    cluster = backend.cluster(handle)
    if handle.state.get("cancel_requested"):
        if exc.kind in CLUSTER_GONE:
            return RunStatus("cancelled", message=f"cancelled; its cluster {cluster} was taken down")
        return RunStatus("running", message=f"being cancelled (SkyPilot: {exc.kind})")
    if exc.kind in CLUSTER_GONE:
        return RunStatus("lost", message=f"its cluster {cluster} is gone or going (torn down, "
                         f"or its lifetime ran out): {exc.kind}")  # fmt: skip
    raise exc


def _launch_status(backend: SkypilotBackend, handle: RunHandle) -> RunStatus:
    rid = backend.request_id(handle)
    if rid is None:
        return RunStatus("pending")
    state = backend.sky().request_state(rid)
    if state in REQUEST_LIVE or state == "SUCCEEDED" or state is None:
        return RunStatus("pending", message=f"launch request {rid}: {state or 'unknown'}")
    verdict = "cancelled" if state == "CANCELLED" else "failed"
    ended = RunStatus(verdict, message=f"launch request {rid}: {state}")
    backend.store.update_state(handle, final_status=ended.__dict__)
    return ended


def _from_worker(
    backend: SkypilotBackend, handle: RunHandle, status: RunStatus, record: dict[str, Any] | None
) -> RunStatus:
    """The worker's own record says more (timed out, exit code, times);
    it must agree with SkyPilot's verdict, or SkyPilot's stands. `record`:
    the final one poll() read just before, or None to read it now (then it
    may be out of reach)."""
    if record is None:
        try:
            record = backend.remote_run(handle).status()
        except SubstraxError as exc:
            note = f"the worker's record is out of reach: {exc}"
            return RunStatus(status.state, message=f"{status.message} ({note})")
    worker = status_from_record(record if record.get("state") else None, worker_alive=False)
    agrees = (worker.state == "succeeded") == (status.state == "succeeded")
    if not worker.final or not agrees:
        return status
    if worker.state == "lost":
        # No end in its record: the worker was killed (SkyPilot's cancel
        # on Slurm does not wait for it), which SkyPilot's verdict says.
        return RunStatus(status.state, started_at=worker.started_at, message=status.message)
    return worker
