"""The SkyPilot backend: the step runs on a cluster SkyPilot launches for it.

One cluster per run, launched with one SkyPilot task (sky_task.py): COPY
file mounts bring the remote scripts, the job file and a snapshot of the
project; the task's setup arms the lifetime timer, runs setup_commands and
builds the locked environment; its run is the worker, in the foreground, so
SkyPilot's job status is the run's and SkyPilot's cancel reaches its tree.
Launch also arms SkyPilot's autodown, so an idle cluster goes by itself.

Every SkyPilot call is one process of sky_helper/sky_sdk.py in SkyPilot's own
interpreter (_sky.py). Outputs come back as from an SSH host (_remote_run.py,
over the ssh config SkyPilot writes) or from the bucket the worker wrote.

State in the handle: cluster, job_id, remote paths; in the run's folder:
task.json (the intent, written before launch) and launch-request.json
(SkyPilot's request id, written the moment it exists).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from substrax_tasks._atomic import write_json_atomic
from substrax_tasks._openssh import ClusterTarget
from substrax_tasks._output import emit
from substrax_tasks._remote_files import remote_dir
from substrax_tasks._sky import (
    CLUSTER_GONE,
    REQUEST_LIVE,
    LogRelay,
    SkyCallError,
    SkyClient,
    job_state,
)
from substrax_tasks.backends import _remote_run, sky_task
from substrax_tasks.backends._remote_run import RemoteRun, forwarded_env
from substrax_tasks.backends.base import Backend, Fetched, RunStatus
from substrax_tasks.backends.skypilot_settings import SkypilotSettings
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.handle import RunHandle
from substrax_tasks.machines import Leak, cluster_leaks
from substrax_tasks.store import RunStore
from substrax_tasks.transports.rsync import RsyncTransport

if sys.version_info < (3, 11):  # pragma: no cover - 3.10 only
    from exceptiongroup import ExceptionGroup

LAUNCH_REQUEST = "launch-request.json"
TASK_FILE = "task.json"


class SkyConfigRefused(SubstraxError):
    """SkyPilot refused the generated task: a configuration error, not retried."""


class SkypilotBackend(Backend):
    name = "skypilot"
    Settings = SkypilotSettings
    settings: SkypilotSettings

    def __init__(self, settings: BaseModel, store: RunStore) -> None:
        super().__init__(settings, store)
        self._ssh_config_written: set[str] = set()  # clusters asked once in this process

    # ------------------------------------------------------------ helpers
    def sky(self) -> SkyClient:
        return SkyClient(self.settings.sky_python)

    def cluster(self, handle: RunHandle) -> str:
        recorded = handle.state.get("cluster")
        return recorded if isinstance(recorded, str) else sky_task.cluster_name(self.settings, handle)

    def layout(self, handle: RunHandle) -> sky_task.ClusterLayout:
        return sky_task.layout_for(self.settings, handle)

    def _run_file(self, handle: RunHandle, name: str) -> Path:
        return self.store.run_dir(handle.run_id) / name

    def _request_id(self, handle: RunHandle) -> str | None:
        try:
            data = json.loads(self._run_file(handle, LAUNCH_REQUEST).read_text())
        except (OSError, ValueError):
            return None
        rid = data.get("request_id") if isinstance(data, dict) else None
        return rid if isinstance(rid, str) else None

    def target(self, handle: RunHandle) -> ClusterTarget:
        cluster = self.cluster(handle)
        return ClusterTarget(cluster, Path.home() / ".sky" / "generated" / "ssh" / cluster)

    def _write_ssh_config(self, handle: RunHandle) -> None:
        """Have SkyPilot (re)write the cluster's ssh config here, as its
        `sky status` does: the one a local API server writes while it
        provisions reaches a Slurm cluster's login node, not the job (see
        sky_helper/sky_sdk.py), and a remote API server writes none here."""
        cluster = self.cluster(handle)
        self._ssh_config_written.add(cluster)
        try:
            self.sky().call("ssh_config", {"cluster_name": cluster, "write": True})
        except SubstraxError as exc:
            emit(f"{handle.step}: could not write the ssh config of {cluster}: {exc}", err=True)

    def remote_run(self, handle: RunHandle) -> RemoteRun:
        """The run's folder on the cluster, over the ssh config SkyPilot wrote."""
        target = self.target(handle)
        if not target.config_file.is_file() and target.host not in self._ssh_config_written:
            self._write_ssh_config(handle)  # another machine's launch, or one before an upgrade
        if not target.config_file.is_file():
            raise BackendError(
                f"run {handle.run_id}: no ssh access to cluster {target.host} "
                f"({target.config_file} is missing: the cluster is down, or was launched from another home)"
            )
        layout = self.layout(handle)
        if not layout.root.startswith("/"):  # where the job runs, not where a shell over ssh starts
            layout = sky_task.at_job_home(layout, self.sky(), self.store, handle, self.cluster(handle))
        return RemoteRun(target, self.settings.python, layout.bin, layout.run)

    # ------------------------------------------------------------- launch
    def launch(self, handle: RunHandle) -> RunHandle:
        project = Path(str(handle.state["project"]))
        layout = self.layout(handle)
        lock, env_dir = sky_task.environment(self.settings, layout, project)
        upload = self._run_file(handle, "upload")
        left_out = sky_task.snapshot(self.settings, handle, project, self.store.root, upload / "project")
        (upload / "in").mkdir(parents=True, exist_ok=True)
        job = sky_task.worker_job(self.settings, handle, layout, env_dir, left_out)
        write_json_atomic(upload / "in" / "job.json", job)
        config = sky_task.task_config(
            self.settings, handle, layout, upload_dir=upload, remote_dir=remote_dir(),
            project=project, lock=lock, env_dir=env_dir,
        )  # fmt: skip
        cluster = self.cluster(handle)
        # The intent, before any paid call: what would be launched, and where.
        write_json_atomic(self._run_file(handle, TASK_FILE), config)
        handle = self.store.update_state(
            handle, cluster=cluster, remote_run=layout.run, bin_digest=layout.bin_digest
        )
        self._validate(config)
        log = self._run_file(handle, "launch.log")
        relay = LogRelay(log, f"{handle.step}: ")
        rid = self._request_id(handle)
        state = self.sky().request_state(rid) if rid else None
        if rid and state in (*REQUEST_LIVE, "SUCCEEDED"):
            emit(f"{handle.step}: waiting for launch request {rid} of cluster {cluster}")
            result = self.sky().call("wait_launch", {"request_id": rid, "log_file": str(log)},
                                     timeout=None, while_waiting=relay)  # fmt: skip
        else:
            emit(f"{handle.step}: launching cluster {cluster} (SkyPilot; `substrax-compute cancel "
                 f"{handle.run_id}` stops it)")  # fmt: skip
            request = {
                "task": config,
                "cluster_name": cluster,
                "idle_minutes_to_autostop": self.settings.idle_minutes,
                "down": True,
                "retry_until_up": self.settings.retry_until_up,
                "request_file": str(self._run_file(handle, LAUNCH_REQUEST)),
                "log_file": str(log),
                # values read now, sent on stdin: never written to a file
                "secrets": forwarded_env(handle),
            }
            try:
                result = self.sky().call("launch", request, timeout=None, while_waiting=relay)
            except KeyboardInterrupt:
                rid = self._request_id(handle)
                if rid:
                    emit(f"\n{handle.step}: launch request {rid} goes on in SkyPilot's API server; "
                         f"`doit {handle.step}` waits for it again, `substrax-compute cancel "
                         f"{handle.run_id}` stops it and takes the cluster down", err=True)  # fmt: skip
                raise
        job_id = result.get("job_id") if isinstance(result, dict) else None
        if not isinstance(job_id, int):
            raise BackendError(f"run {handle.run_id}: SkyPilot launched {cluster} but submitted no job")
        timer = sky_task.lifetime_timer(self.settings)  # armed by the task's setup, before this
        handle = self.store.update_state(handle, job_id=job_id, watchdog=timer)
        self._write_ssh_config(handle)
        return handle

    def _validate(self, config: dict[str, Any]) -> None:
        # check_file_mounts: the snapshot and sources exist by now
        request = {"task": config, "needs_storage_mounting": self.settings.bucket is not None,
                   "check_file_mounts": True}  # fmt: skip
        try:
            self.sky().call("validate", request)
        except SkyCallError as exc:
            hint = ""
            if exc.kind == "NotSupportedError" and self.settings.bucket is not None:
                hint = ("; this provider cannot mount buckets: use the copy transport "
                        "([tool.substrax.compute.backends.skypilot.copy])")  # fmt: skip
            raise SkyConfigRefused(
                f"SkyPilot refused the task for this step ({exc.kind}: {exc.detail}){hint}; "
                "check [tool.substrax.compute.backends.skypilot] and the step's resources"
            ) from None

    def start(self, handle: RunHandle) -> RunHandle:
        """The launch submitted the job already (SkyPilot runs setup, then it)."""
        if not isinstance(handle.state.get("job_id"), int):
            raise BackendError(f"run {handle.run_id}: it was never launched")
        return handle

    # ------------------------------------------------------------- status
    def poll(self, handle: RunHandle) -> RunStatus:
        cached = handle.state.get("final_status")
        if not isinstance(cached, dict):
            # A caller's copy of the handle may predate the end: once the
            # cluster is down, the store's record is all that tells it.
            with contextlib.suppress(SubstraxError):
                cached = self.store.read(handle.run_id).state.get("final_status")
        if isinstance(cached, dict):
            return RunStatus(**cached)
        job_id = handle.state.get("job_id")
        if not isinstance(job_id, int):
            return self._launch_status(handle)
        try:
            answer = self.sky().call(
                "job_status", {"cluster_name": self.cluster(handle), "job_ids": [job_id]}
            )
        except SkyCallError as exc:
            return self._status_after_error(handle, exc)
        value = (answer or {}).get(str(job_id))
        if value is None:
            return RunStatus("lost", message=f"job {job_id} is not in the queue of {self.cluster(handle)}")
        state = job_state(value)
        if state == "running":
            return RunStatus("running", message=str(value))
        status = self._final_from_worker(handle, RunStatus(state, message=f"SkyPilot job {value}"))
        self.store.update_state(handle, final_status=status.__dict__)
        return status

    def _status_after_error(self, handle: RunHandle, exc: SkyCallError) -> RunStatus:
        """SkyPilot could not read the job's status. While another process
        cancels the run, its cluster is going: SkyPilot then fails in ways
        of its own (on Slurm, a CommandError once the cluster's runtime is
        removed), which say nothing about the run; the canceller's record
        tells the end."""
        with contextlib.suppress(SubstraxError):
            handle = self.store.read(handle.run_id)
        final = handle.state.get("final_status")
        if isinstance(final, dict):
            return RunStatus(**final)
        cluster = self.cluster(handle)
        if handle.state.get("cancel_requested"):
            if exc.kind in CLUSTER_GONE:
                return RunStatus("cancelled", message=f"cancelled; its cluster {cluster} was taken down")
            return RunStatus("running", message=f"being cancelled (SkyPilot: {exc.kind})")
        if exc.kind in CLUSTER_GONE:
            return RunStatus("lost", message=f"its cluster {cluster} is gone or going (torn down, "
                             f"or its lifetime ran out): {exc.kind}")  # fmt: skip
        raise exc

    def _launch_status(self, handle: RunHandle) -> RunStatus:
        rid = self._request_id(handle)
        if rid is None:
            return RunStatus("pending")
        state = self.sky().request_state(rid)
        if state in REQUEST_LIVE or state == "SUCCEEDED" or state is None:
            return RunStatus("pending", message=f"launch request {rid}: {state or 'unknown'}")
        verdict = "cancelled" if state == "CANCELLED" else "failed"
        ended = RunStatus(verdict, message=f"launch request {rid}: {state}")
        self.store.update_state(handle, final_status=ended.__dict__)
        return ended

    def _final_from_worker(self, handle: RunHandle, status: RunStatus) -> RunStatus:
        """The worker's own record says more (timed out, exit code, times);
        it must agree with SkyPilot's verdict, or SkyPilot's stands."""
        from substrax_tasks.worker_job import status_from_record

        try:
            record = self.remote_run(handle).status()
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

    # ------------------------------------------------------------- cancel
    def cancel(self, handle: RunHandle) -> bool:
        """Cancel the launch request if still in flight, the job, then the
        cluster; every step is attempted, and the failures are raised
        together as an ExceptionGroup."""
        status = self.poll(handle)
        if status.final and status.state != "lost":
            return False
        # Told first: a client waiting on the run reads SkyPilot's failures
        # while the cluster goes as the cancel they are (_status_after_error).
        handle = self.store.update_state(handle, cancel_requested=True)
        cluster = self.cluster(handle)
        failures: list[Exception] = []
        rid = self._request_id(handle)
        if rid is not None:
            try:
                if self.sky().request_state(rid) in REQUEST_LIVE:
                    self.sky().call("api_cancel", {"request_ids": [rid]})
            except SubstraxError as exc:
                failures.append(BackendError(f"cancelling launch request {rid}: {exc}"))
        job_id = handle.state.get("job_id")
        if isinstance(job_id, int):
            try:
                self.sky().call("cancel", {"cluster_name": cluster, "job_ids": [job_id]})
            except SubstraxError as exc:  # a cluster gone or going: the down below ends it all the same
                if not (isinstance(exc, SkyCallError) and exc.kind in CLUSTER_GONE):
                    failures.append(BackendError(f"cancelling job {job_id} on {cluster}: {exc}"))
        gone = self._down(handle, failures)
        if gone:
            ended = RunStatus("cancelled", message="cancelled; its cluster was taken down")
            self.store.update_state(handle, final_status=ended.__dict__, torn_down=True)
        if failures:
            raise ExceptionGroup(f"run {handle.run_id}: {len(failures)} cancel step(s) failed", failures)
        return True

    def _down(self, handle: RunHandle, failures: list[Exception]) -> bool:
        cluster = self.cluster(handle)
        try:
            self.sky().down(cluster)
        except SubstraxError as exc:
            failures.append(BackendError(f"taking cluster {cluster} down: {exc}"))
            return False
        self.target(handle).stop_master()
        return True

    def leaks(self, project: str, handles: list[RunHandle]) -> list[Leak]:
        return cluster_leaks(self, handles)

    # --------------------------------------------------------------- logs
    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        kept = _remote_run.read_kept_log(self._run_file(handle, "run.log"), offset)
        if kept is not None:
            return kept
        if not isinstance(handle.state.get("job_id"), int) or handle.state.get("torn_down"):
            return b""
        try:
            return self.remote_run(handle).read_log(offset)
        except BackendError:
            return b""

    @property
    def poll_seconds(self) -> float:
        return self.settings.poll_seconds  # each read is a process that imports sky

    # -------------------------------------------------------------- fetch
    def fetch(self, handle: RunHandle) -> Fetched:
        staging = self._run_file(handle, "fetched")
        if self.settings.bucket is None:  # copy: as the SSH backend fetches, over SkyPilot's ssh config
            transport = RsyncTransport(self.target(handle))
            return self.remote_run(handle).fetch(transport, list(handle.spec.outputs), staging)
        from substrax_tasks.transports.bucket import BucketTransport

        run_folder = f"{self.settings.bucket.outputs_bucket}/{handle.run_id}"
        manifest = BucketTransport().fetch_run(run_folder, list(handle.spec.outputs), staging)
        return Fetched(staging, manifest)

    def outputs_available(self, handle: RunHandle) -> bool:
        if self.settings.bucket is not None:
            from substrax_tasks.transports.bucket import BucketTransport

            try:
                BucketTransport().read_manifest(f"{self.settings.bucket.outputs_bucket}/{handle.run_id}/manifest.json")
            except SubstraxError:
                return False
            return True
        if handle.state.get("torn_down"):
            return False
        try:
            return bool(self.remote_run(handle).status().get("exists"))
        except SubstraxError:
            return False

    # ----------------------------------------------------------- teardown
    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        """Take the cluster down (keeping the handle and a copy of the log)."""
        shutil.rmtree(self._run_file(handle, "fetched"), ignore_errors=True)  # as the ssh backend
        if handle.state.get("torn_down"):
            return
        if "cluster" not in handle.state:
            return  # never launched: nothing was made
        if not self.poll(handle).final:
            try:
                self.cancel(handle)
            except ExceptionGroup as group:  # one message for doit and the CLI alike
                raise BackendError("; ".join(str(e) for e in group.exceptions)) from None
            return
        with contextlib.suppress(SubstraxError, OSError):
            self.remote_run(handle).keep_log(self._run_file(handle, "run.log"))
        failures: list[Exception] = []
        if not self._down(handle, failures):
            raise failures[0]
        self.store.update_state(handle, torn_down=True)
