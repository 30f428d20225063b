"""How a SkyPilot run's status is read: the job's status in SkyPilot's
queue, the launch request's before there is a job, and, once the job has
ended, the worker's own record where it agrees with SkyPilot's verdict.
The final status is kept in the handle: a cluster taken down says nothing.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from substrax_tasks._sky import CLUSTER_GONE, REQUEST_LIVE, SkyCallError, job_state
from substrax_tasks.backends.base import RunStatus
from substrax_tasks.errors import SubstraxError
from substrax_tasks.handle import RunHandle
from substrax_tasks.worker_job import status_from_record

if TYPE_CHECKING:
    from substrax_tasks.backends.skypilot import SkypilotBackend


def poll(backend: SkypilotBackend, handle: RunHandle) -> RunStatus:
    cached = handle.state.get("final_status")
    if not isinstance(cached, dict):
        # A caller's copy of the handle may predate the end: once the
        # cluster is down, the store's record is all that tells it.
        with contextlib.suppress(SubstraxError):
            cached = backend.store.read(handle.run_id).state.get("final_status")
    if isinstance(cached, dict):
        return RunStatus(**cached)
    job_id = handle.state.get("job_id")
    if not isinstance(job_id, int):
        return _launch_status(backend, handle)
    try:
        answer = backend.sky().call(
            "job_status", {"cluster_name": backend.cluster(handle), "job_ids": [job_id]}
        )
    except SkyCallError as exc:
        return _after_error(backend, handle, exc)
    value = (answer or {}).get(str(job_id))
    if value is None:
        return RunStatus("lost", message=f"job {job_id} is not in the queue of {backend.cluster(handle)}")
    state = job_state(value)
    if state == "running":
        return RunStatus("running", message=str(value))
    status = _from_worker(backend, handle, RunStatus(state, message=f"SkyPilot job {value}"))
    if "slot" in handle.state:  # kept now: another run's teardown may take the shared cluster down
        with contextlib.suppress(SubstraxError, OSError):
            backend.remote_run(handle).keep_log(backend.run_file(handle, "run.log"))
    backend.store.update_state(handle, final_status=status.__dict__)
    return status


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


def _from_worker(backend: SkypilotBackend, handle: RunHandle, status: RunStatus) -> RunStatus:
    """The worker's own record says more (timed out, exit code, times);
    it must agree with SkyPilot's verdict, or SkyPilot's stands."""
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
