"""The SkyPilot backend: the step runs on a cluster SkyPilot launches for it.

One cluster per run (with `reuse = true`, clusters the steps of one shape
take turns on: sky_pool.py), launched with one SkyPilot task (sky_task.py): COPY
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
import time
from pathlib import Path
from typing import IO

from pydantic import BaseModel

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends import remote_run as _remote_run
from substrax_tasks.backends.base import LOG_POLL_SECONDS, Backend, Fetched, Pool, RunStatus
from substrax_tasks.backends.remote_run import DamagedHost, RemoteRun, forwarded_env
from substrax_tasks.backends.scripts import remote_dir
from substrax_tasks.backends.skypilot import pool as sky_pool
from substrax_tasks.backends.skypilot import status as sky_status
from substrax_tasks.backends.skypilot import task as sky_task
from substrax_tasks.backends.skypilot.client import (
    CLUSTER_GONE,
    REQUEST_LIVE,
    LogRelay,
    SkyCallError,
    SkyClient,
)
from substrax_tasks.backends.skypilot.settings import SkypilotSettings
from substrax_tasks.backends.ssh.openssh import ClusterTarget
from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.interrupts import check_interrupted
from substrax_tasks.store.gc import Leak, cluster_leaks
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.run_store import RunStore
from substrax_tasks.transports.rsync import RsyncTransport

if sys.version_info < (3, 11):  # pragma: no cover - 3.10 only
    from exceptiongroup import ExceptionGroup

LAUNCH_REQUEST = "launch-request.json"
TASK_FILE = "task.json"


def cluster_target(cluster: str) -> ClusterTarget:
    return ClusterTarget(cluster, Path.home() / ".sky" / "generated" / "ssh" / cluster)


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
        if isinstance(recorded, str):
            return recorded
        return sky_task.cluster_name(self.settings, handle, self.store.client_id())

    def layout(self, handle: RunHandle) -> sky_task.ClusterLayout:
        return sky_task.layout_for(self.settings, handle)

    def run_file(self, handle: RunHandle, name: str) -> Path:
        return self.store.run_dir(handle.run_id) / name

    def request_id(self, handle: RunHandle) -> str | None:
        try:
            data = json.loads(self.run_file(handle, LAUNCH_REQUEST).read_text())
        except (OSError, ValueError):
            return None
        rid = data.get("request_id") if isinstance(data, dict) else None
        return rid if isinstance(rid, str) else None

    def target(self, handle: RunHandle) -> ClusterTarget:
        return cluster_target(self.cluster(handle))

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

    def slot_pool(self, handle: RunHandle) -> Pool | None:
        """max_parallel clusters per shape; with reuse, a slot is a cluster runs take turns on."""
        if self.settings.max_parallel is None:
            return None
        name, limit = f"skypilot-{sky_pool.shape(self, handle)}", self.settings.max_parallel
        resources = self.settings.resources(dict(handle.spec.resources))
        where = "SkyPilot (" + ", ".join(f"{k}={v}" for k, v in sorted(resources.items())) + ")"
        warm = sky_pool.warm_slots(self.store.slots_dir(name), limit) if self.settings.reuse else ()
        return Pool(name, limit, where, shared=self.settings.reuse, prefer=warm)

    # ------------------------------------------------------------- launch
    def launch(self, handle: RunHandle) -> RunHandle:
        project = Path(str(handle.state["project"]))
        layout = self.layout(handle)
        lock, env_dir = sky_task.environment(self.settings, layout, project)
        upload = self.run_file(handle, "upload")
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
        write_json_atomic(self.run_file(handle, TASK_FILE), config)
        handle = self.store.update_state(
            handle, cluster=cluster, remote_run=layout.run, bin_digest=layout.bin_digest
        )
        log = self.run_file(handle, "launch.log")
        relay = LogRelay(log, f"{handle.step}: ")
        rid = self.request_id(handle)
        state = self.sky().request_state(rid) if rid else None
        warm = sky_pool.warm_cluster(self, handle, env_dir) if self.settings.reuse and not rid else None
        if rid and state in (*REQUEST_LIVE, "SUCCEEDED"):
            emit(f"{handle.step}: waiting for launch request {rid} of cluster {cluster}")
            result = self.sky().call("wait_launch", {"request_id": rid, "log_file": str(log)},
                                     timeout=None, while_waiting=relay)  # fmt: skip
        elif not (warm and (result := sky_pool.exec_on(self, handle, warm, config, upload)) is not None):
            sky_task.validate(self.sky(), self.settings, config)  # a warm cluster ran this shape already
            handle = self.store.update_state(handle, cluster=cluster, job_home=None)  # not the warm one tried
            warm = None
            sky_pool.record_launch(self, handle, cluster, env_dir)
            emit(f"{handle.step}: launching cluster {cluster} (SkyPilot; `substrax-compute cancel "
                 f"{handle.run_id}` stops it)")  # fmt: skip
            request_file = self.run_file(handle, LAUNCH_REQUEST)
            request = {
                "task": config, "cluster_name": cluster, "down": True, "log_file": str(log),
                "idle_minutes_to_autostop": self.settings.idle_minutes, "request_file": str(request_file),
                "retry_until_up": self.settings.retry_until_up,
                "secrets": forwarded_env(handle),  # values read now, sent on stdin: never written to a file
            }  # fmt: skip
            try:
                result = self.sky().call("launch", request, timeout=None, while_waiting=relay)
            except KeyboardInterrupt:
                rid = self.request_id(handle)
                if rid:
                    emit(f"\n{handle.step}: launch request {rid} goes on in SkyPilot's API server; "
                         f"`doit {handle.step}` waits for it again, `substrax-compute cancel "
                         f"{handle.run_id}` stops it and takes the cluster down", err=True)  # fmt: skip
                raise
        job_id = result.get("job_id") if isinstance(result, dict) else None
        if not isinstance(job_id, int):
            raise BackendError(f"run {handle.run_id}: SkyPilot launched {cluster} but submitted no job")
        handle = self.store.update_state(handle, job_id=job_id)
        if not warm:
            timer = sky_task.lifetime_timer(self.settings)  # armed by the task's setup, before this
            handle = self.store.update_state(handle, watchdog=timer)
            self._write_ssh_config(handle)
        return handle

    def start(self, handle: RunHandle) -> RunHandle:
        """The launch submitted the job already (SkyPilot runs setup, then it)."""
        if not isinstance(handle.state.get("job_id"), int):
            raise BackendError(f"run {handle.run_id}: it was never launched")
        return handle

    # ------------------------------------------------------------- status
    def poll(self, handle: RunHandle) -> RunStatus:
        return sky_status.poll(self, handle)

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
        rid = self.request_id(handle)
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
        shared = "slot" in handle.state and isinstance(job_id, int)  # a reused cluster: the job only
        if shared and not failures:
            ended = RunStatus("cancelled", message=f"job cancelled; cluster {cluster} stays for other runs")
            self.store.update_state(handle, final_status=ended.__dict__)
        elif not shared and self._down(handle, failures):
            ended = RunStatus("cancelled", message="cancelled; its cluster was taken down")
            self.store.update_state(handle, final_status=ended.__dict__, torn_down=True)
        if failures:
            raise ExceptionGroup(f"run {handle.run_id}: {len(failures)} cancel step(s) failed", failures)
        return True

    def _down(self, handle: RunHandle, failures: list[Exception]) -> bool:
        return self.down_cluster(self.cluster(handle), failures)

    def down_cluster(self, cluster: str, failures: list[Exception]) -> bool:
        try:
            self.sky().down(cluster)
        except SubstraxError as exc:
            failures.append(BackendError(f"taking cluster {cluster} down: {exc}"))
            return False
        cluster_target(cluster).stop_master()
        return True

    def leaks(self, project: str, handles: list[RunHandle]) -> list[Leak]:
        return cluster_leaks(self, handles)

    # --------------------------------------------------------------- logs
    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        kept = _remote_run.read_kept_log(self.run_file(handle, "run.log"), offset)
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
        return self.settings.poll_seconds  # each read may be a process that imports sky

    def stream_log(
        self, handle: RunHandle, out: IO[bytes], follow: bool = False, offset: int = 0
    ) -> RunStatus:
        """With follow, one follower on the cluster streams the log until the
        run ends (_remote_run.follow_log), once the worker's record says the
        run started. Not before: a job still waits in SkyPilot's queue (a
        reused cluster runs one after another), and SkyPilot may cancel it
        there, with no worker to end a follower; until then the status is
        read every poll_seconds."""
        if not follow:
            return super().stream_log(handle, out, offset=offset)
        status = self.poll(handle)
        next_poll = time.monotonic() + self.poll_seconds
        while not status.final and not sky_status.worker_started(status):
            check_interrupted()
            time.sleep(LOG_POLL_SECONDS)  # Ctrl-C in a doit thread is seen within this
            if time.monotonic() >= next_poll:
                status = self.poll(handle)
                next_poll = time.monotonic() + self.poll_seconds
        if status.final:
            return super().stream_log(handle, out, offset=offset)
        return _remote_run.follow_log(self, handle, out, offset, self.remote_run(handle))

    # -------------------------------------------------------------- fetch
    def fetch(self, handle: RunHandle) -> Fetched:
        staging = self.run_file(handle, "fetched")
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
                BucketTransport().read_manifest(
                    f"{self.settings.bucket.outputs_bucket}/{handle.run_id}/manifest.json"
                )
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
    def forget(self, handle: RunHandle) -> str:
        cluster = handle.state.get("cluster")
        if not isinstance(cluster, str) or handle.state.get("torn_down"):
            return "no cluster of it was launched"
        run = self.remote_run(handle)
        run.remove()  # its tree stopped first, as teardown cancels before the cluster goes
        if "slot" in handle.state:  # a warm cluster other steps take turns on: only this run goes
            return f"stopped it and removed its folder {run.run_dir} on cluster {cluster}"
        failures: list[Exception] = []
        if not self.down_cluster(cluster, failures):
            raise failures[0]
        return f"stopped it and took its cluster {cluster} down"

    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        """Take the cluster down (keeping the handle and a copy of the log)."""
        shutil.rmtree(self.run_file(handle, "fetched"), ignore_errors=True)  # as the ssh backend
        if handle.state.get("torn_down"):
            return
        if "cluster" not in handle.state:
            return  # never launched: nothing was made
        try:
            running, damaged = not self.poll(handle).final, False
        except DamagedHost:  # its scripts were changed there: nothing on it is run, it goes down whole
            running, damaged = False, True
        if running:
            try:
                self.cancel(handle)
            except ExceptionGroup as group:  # one message for doit and the CLI alike
                raise BackendError("; ".join(str(e) for e in group.exceptions)) from None
            return
        with contextlib.suppress(SubstraxError, OSError):
            self.remote_run(handle).keep_log(self.run_file(handle, "run.log"))
        failures: list[Exception] = []
        if "slot" in handle.state and not (force or damaged):
            sky_pool.leave(self, handle)
        elif not self._down(handle, failures):
            raise failures[0]
        self.store.update_state(handle, torn_down=True)
