"""The SkyPilot backend: the step runs on a cluster SkyPilot launches for it.

One cluster per run (with `reuse = true`, clusters the steps of one shape
take turns on: py), launched with one SkyPilot task (sky_task.py): COPY
file mounts bring the remote scripts, the job file and a snapshot of the
project; the task's setup arms the lifetime timer, runs setup_commands and
builds the locked environment; its run is the worker, in the foreground, so
SkyPilot's job status is the run's and SkyPilot's cancel reaches its tree.
Launch also arms SkyPilot's autodown, so an idle cluster goes by itself.

Every SkyPilot call is one process of helper/sky_sdk.py in SkyPilot's own
interpreter (client.py). Outputs come back as from an SSH host (_remote_run.py,
over the ssh config SkyPilot writes) or from the bucket the worker wrote.

State in the handle: cluster, job_id, remote paths; in the run's folder:
task.json (the intent, written before launch) and launch-request.json
(SkyPilot's request id, written the moment it exists).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import sys
import time
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel

from substrax_tasks._remote import runfiles
from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends import remote_run as _remote_run
from substrax_tasks.backends.base import FINAL_STATES, LOG_POLL_SECONDS, Backend, Fetched, Leak, RunStatus
from substrax_tasks.backends.job import status_from_record
from substrax_tasks.backends.remote_run import DamagedHost, RemoteRun, forwarded_env
from substrax_tasks.backends.scripts import remote_dir
from substrax_tasks.backends.skypilot import task as sky_task
from substrax_tasks.backends.skypilot.client import (
    CLUSTER_GONE,
    REQUEST_LIVE,
    LogRelay,
    SkyCallError,
    SkyClient,
    job_state,
)
from substrax_tasks.backends.skypilot.settings import SkypilotSettings
from substrax_tasks.backends.skypilot.state import SkypilotState
from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError, SubstraxError
from substrax_tasks.interrupts import check_interrupted
from substrax_tasks.slots import Pool
from substrax_tasks.step.spec import canonical_digest, settings_in_key
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.run_store import RunStore
from substrax_tasks.transports.openssh import ClusterTarget
from substrax_tasks.transports.rsync import RsyncTransport

if sys.version_info < (3, 11):  # pragma: no cover - 3.10 only
    from exceptiongroup import ExceptionGroup

LAUNCH_REQUEST = "launch-request.json"
TASK_FILE = "task.json"


def cluster_target(cluster: str) -> ClusterTarget:
    return ClusterTarget(cluster, Path.home() / ".sky" / "generated" / "ssh" / cluster)


def cluster_leaks(backend: SkypilotBackend, handles: list[RunHandle]) -> list[Leak]:
    """Clusters of the prefix that no live handle names. Those a handle of
    the client named, or whose name carries its id, are its own; the rest
    may be another client's (the prefix is shared by default, and so may be
    the project's path), so are listed, never removed."""
    runs = [h for h in handles if h.backend == backend.name]
    live = {SkypilotState.of(h).cluster for h in runs if not SkypilotState.of(h).torn_down}
    named = {SkypilotState.of(h).cluster for h in runs}
    prefix, client = backend.settings.cluster_prefix, backend.store.client_id()
    return [
        Leak(backend.name, "SkyPilot", name, name in named or sky_task.made_by(name, prefix, client),
             functools.partial(backend.sky().down, name))
        for name in backend.sky().cluster_names()
        if name.startswith(f"{prefix}-") and name not in live
    ]



class SkypilotBackend(Backend):
    name = "skypilot"
    Settings = SkypilotSettings
    State = SkypilotState
    settings: SkypilotSettings

    def __init__(self, settings: BaseModel, store: RunStore) -> None:
        super().__init__(settings, store)
        self._ssh_config_written: set[str] = set()  # clusters asked once in this process

    # ------------------------------------------------------------ helpers
    def sky(self) -> SkyClient:
        return SkyClient(self.settings.sky_python)

    def cluster(self, handle: RunHandle) -> str:
        recorded = SkypilotState.of(handle).cluster
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
        helper/sky_sdk.py), and a remote API server writes none here."""
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
        name, limit = f"skypilot-{shape(self, handle)}", self.settings.max_parallel
        resources = self.settings.resources(dict(handle.spec.resources))
        where = "SkyPilot (" + ", ".join(f"{k}={v}" for k, v in sorted(resources.items())) + ")"
        warm = warm_slots(self.store.slots_dir(name), limit) if self.settings.reuse else ()
        return Pool(name, limit, where, shared=self.settings.reuse, prefer=warm)

    # ------------------------------------------------------------- launch
    def launch(self, handle: RunHandle) -> RunHandle:
        project = Path(str(handle.state.project))
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
        handle = self.save_state(
            handle, cluster=cluster, remote_run=layout.run, bin_digest=layout.bin_digest
        )
        log = self.run_file(handle, "launch.log")
        relay = LogRelay(log, f"{handle.step}: ")
        rid = self.request_id(handle)
        state = self.sky().request_state(rid) if rid else None
        warm = warm_cluster(self, handle, env_dir) if self.settings.reuse and not rid else None
        if rid and state in (*REQUEST_LIVE, "SUCCEEDED"):
            emit(f"{handle.step}: waiting for launch request {rid} of cluster {cluster}")
            result = self.sky().call("wait_launch", {"request_id": rid, "log_file": str(log)},
                                     timeout=None, while_waiting=relay)  # fmt: skip
        elif not (warm and (result := exec_on(self, handle, warm, config, upload)) is not None):
            sky_task.validate(self.sky(), self.settings, config)  # a warm cluster ran this shape already
            handle = self.save_state(handle, cluster=cluster, job_home=None)  # not the warm one tried
            warm = None
            record_launch(self, handle, cluster, env_dir)
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
        handle = self.save_state(handle, job_id=job_id)
        if not warm:
            timer = sky_task.lifetime_timer(self.settings)  # armed by the task's setup, before this
            handle = self.save_state(handle, watchdog=timer)
            self._write_ssh_config(handle)
        return handle

    def start(self, handle: RunHandle) -> RunHandle:
        """The launch submitted the job already (SkyPilot runs setup, then it)."""
        if not isinstance(SkypilotState.of(handle).job_id, int):
            raise BackendError(f"run {handle.run_id}: it was never launched")
        return handle

    # ------------------------------------------------------------- status
    def poll(self, handle: RunHandle) -> RunStatus:
        return poll(self, handle)

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
        handle = self.save_state(handle, cancel_requested=True)
        cluster = self.cluster(handle)
        failures: list[Exception] = []
        rid = self.request_id(handle)
        if rid is not None:
            try:
                if self.sky().request_state(rid) in REQUEST_LIVE:
                    self.sky().call("api_cancel", {"request_ids": [rid]})
            except SubstraxError as exc:
                failures.append(BackendError(f"cancelling launch request {rid}: {exc}"))
        job_id = SkypilotState.of(handle).job_id
        if isinstance(job_id, int):
            try:
                self.sky().call("cancel", {"cluster_name": cluster, "job_ids": [job_id]})
            except SubstraxError as exc:  # a cluster gone or going: the down below ends it all the same
                if not (isinstance(exc, SkyCallError) and exc.kind in CLUSTER_GONE):
                    failures.append(BackendError(f"cancelling job {job_id} on {cluster}: {exc}"))
        shared = handle.state.slot is not None and isinstance(job_id, int)  # a reused cluster: the job only
        if shared and not failures:
            ended = RunStatus("cancelled", message=f"job cancelled; cluster {cluster} stays for other runs")
            self.save_state(handle, final_status=ended.__dict__)
        elif not shared and self._down(handle, failures):
            ended = RunStatus("cancelled", message="cancelled; its cluster was taken down")
            self.save_state(handle, final_status=ended.__dict__, torn_down=True)
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
        if not isinstance(SkypilotState.of(handle).job_id, int) or SkypilotState.of(handle).torn_down:
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
        while not status.final and not worker_started(status):
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

    def ran_on(self, handle: RunHandle) -> str:
        return self.cluster(handle)

    @classmethod
    def released(cls, handle: RunHandle) -> bool:
        return SkypilotState.of(handle).torn_down

    @classmethod
    def lifetime_left(cls, handle: RunHandle, now: float | None = None) -> float | None:
        return _remote_run.lifetime_left(SkypilotState.of(handle), now)

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
        if SkypilotState.of(handle).torn_down:
            return False
        try:
            return bool(self.remote_run(handle).status().get("exists"))
        except SubstraxError:
            return False

    # ----------------------------------------------------------- teardown
    def forget(self, handle: RunHandle) -> str:
        cluster = SkypilotState.of(handle).cluster
        if not isinstance(cluster, str) or SkypilotState.of(handle).torn_down:
            return "no cluster of it was launched"
        run = self.remote_run(handle)
        run.remove()  # its tree stopped first, as teardown cancels before the cluster goes
        if handle.state.slot is not None:  # a warm cluster other steps take turns on: only this run goes
            return f"stopped it and removed its folder {run.run_dir} on cluster {cluster}"
        failures: list[Exception] = []
        if not self.down_cluster(cluster, failures):
            raise failures[0]
        return f"stopped it and took its cluster {cluster} down"

    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        """Take the cluster down (keeping the handle and a copy of the log)."""
        shutil.rmtree(self.run_file(handle, "fetched"), ignore_errors=True)  # as the ssh backend
        if SkypilotState.of(handle).torn_down:
            return
        if SkypilotState.of(handle).cluster is None:
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
        if handle.state.slot is not None and not (force or damaged):
            leave(self, handle)
        elif not self._down(handle, failures):
            raise failures[0]
        self.save_state(handle, torn_down=True)


# ---- SkyPilot clusters reused across steps (`reuse = true`).

# A job is queued on a warm cluster only if, beyond its timeout, this much of
# the cluster's lifetime is left: for the sync before it and the fetch after.
MARGIN_SECONDS = 120.0


def shape(backend: SkypilotBackend, handle: RunHandle) -> str:
    """Steps of one shape may share a cluster: same settings, same resources."""
    resources = backend.settings.resources(dict(handle.spec.resources))
    return canonical_digest({"settings": settings_in_key(handle.settings), "resources": resources})[:12]


def record_path(backend: SkypilotBackend, handle: RunHandle) -> Path | None:
    slot = handle.state.slot
    if not isinstance(slot, dict):
        return None
    return backend.store.slots_dir(str(slot["pool"])) / f"{slot['index']}.json"


def read_record(path: Path | None) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def warm_slots(folder: Path, limit: int) -> tuple[int, ...]:
    """The slots that hold a cluster: tried first, so a step waits for a warm one."""
    return tuple(i for i in range(limit) if (folder / f"{i}.json").is_file())


def record_launch(backend: SkypilotBackend, handle: RunHandle, cluster: str, env_dir: str | None) -> None:
    """Written before the launch: its deadline is counted from now."""
    path = record_path(backend, handle)
    if path is None:
        return
    transport = backend.settings.transport
    deadline = time.time() + (transport.lifetime_minutes - backend.settings.idle_minutes) * 60
    bin_digest = SkypilotState.of(handle).bin_digest
    write_json_atomic(path, {"cluster": cluster, "deadline": deadline, "bin_digest": bin_digest,
                             "env_dir": env_dir, "run_id": handle.run_id})  # fmt: skip


def warm_cluster(backend: SkypilotBackend, handle: RunHandle, env_dir: str | None) -> dict[str, Any] | None:
    """The slot's cluster if this run may be queued on it; a cluster it may
    not use is taken down (the slot is held: no other run uses it)."""
    path = record_path(backend, handle)
    record = read_record(path)
    if path is None or record is None:
        return None
    timeout = handle.spec.timeout
    left = float(record.get("deadline", 0)) - time.time()
    reason = None
    if record.get("bin_digest") != SkypilotState.of(handle).bin_digest or record.get("env_dir") != env_dir:
        reason = "its scripts or environment are not this run's"
    elif timeout is None:
        reason = "the step has no timeout, so no lifetime left is known to be enough"
    elif left < timeout + MARGIN_SECONDS:
        reason = f"{max(left, 0) / 60:.0f} min of its lifetime left, too few for the step's timeout"
    elif not backend.layout(handle).root.startswith("/") and cluster_home(backend, path, record) is None:
        reason = "the home its jobs run in is not known"
    if reason is None:
        return record
    emit(f"{handle.step}: not reusing cluster {record['cluster']} ({reason}); launching a new one")
    for failure in retire(backend, str(record["cluster"]), path):
        emit(f"{handle.step}: {failure}", err=True)
    return None


def cluster_home(backend: SkypilotBackend, path: Path, record: dict[str, Any]) -> str | None:
    """The home the cluster's jobs run in, as the run that launched it
    learnt it; kept in the slot's record (the slot is held)."""
    if "job_home" not in record:
        with contextlib.suppress(SubstraxError, KeyError):  # a record of no known run: relaunch
            launcher = backend.store.read(str(record["run_id"]))
            home = sky_task.job_home(backend.sky(), backend.store, launcher, str(record["cluster"]))
            if home is not None:
                record["job_home"] = home
                write_json_atomic(path, record)
    home = record.get("job_home")
    return home if isinstance(home, str) else None


def retire(backend: SkypilotBackend, cluster: str, path: Path) -> list[Exception]:
    """Take the slot's cluster down and forget it (the slot is held)."""
    failures: list[Exception] = []
    backend.down_cluster(cluster, failures)
    path.unlink(missing_ok=True)
    return failures


def exec_on(backend: SkypilotBackend, handle: RunHandle, record: dict[str, Any],
            config: dict[str, Any], upload: Path) -> dict[str, Any] | None:  # fmt: skip
    """Queue the run's job on the warm cluster; None if the cluster is gone."""
    cluster, seconds = str(record["cluster"]), max(float(record["deadline"]) - time.time(), 1.0)
    timer = {"armed_at": time.time(), "seconds": seconds}  # what this job arms: the cluster's time left
    home = {"job_home": record["job_home"]} if "job_home" in record else {}
    handle = backend.save_state(handle, cluster=cluster, watchdog=timer, **home)
    layout = backend.layout(handle)
    there = sky_task.at_job_home(layout, backend.sky(), backend.store, handle, cluster)
    emit(f"{handle.step}: queued on warm cluster {cluster} (SkyPilot exec; `substrax-compute cancel "
         f"{handle.run_id}` cancels this job only)")  # fmt: skip
    try:
        transport = RsyncTransport(backend.target(handle))
        transport.upload(upload, ["in", "project"], there.run)
        sources = backend.settings.copy_.source_paths() if backend.settings.copy_ is not None else []
        if sources:
            transport.upload(Path(str(handle.state.project)), sources, there.project)
    except SubstraxError as exc:  # a cluster gone between two runs reads as unreachable
        emit(f"{handle.step}: cluster {cluster} is out of reach ({exc}); launching a new one")
        return None
    task = {key: config[key] for key in ("name", "num_nodes", "resources")}
    task["run"] = sky_task.watchdog_line(backend.settings, layout, seconds) + "\n" + config["run"]
    log = backend.run_file(handle, "launch.log")
    request = {"task": task, "cluster_name": cluster, "log_file": str(log), "secrets": forwarded_env(handle),
               "request_file": str(backend.run_file(handle, "launch-request.json"))}  # fmt: skip
    try:
        result = backend.sky().call(
            "exec", request, timeout=None, while_waiting=LogRelay(log, f"{handle.step}: ")
        )
    except SkyCallError as exc:
        if exc.kind not in CLUSTER_GONE:
            raise
        emit(f"{handle.step}: cluster {cluster} is gone ({exc.kind}); launching a new one")
        return None
    return result if isinstance(result, dict) else {}


def leave(backend: SkypilotBackend, handle: RunHandle) -> None:
    """A finished run's teardown: its cluster goes if no step holds its slot
    (the last user takes it down); else it stays for the step that does."""
    from substrax_tasks.slots import try_take

    path = record_path(backend, handle)
    cluster = backend.cluster(handle)
    record = read_record(path)
    if path is None or record is None or record.get("cluster") != cluster:
        return  # the step that replaced it in the slot took it down
    slot = try_take(path.parent, int((handle.state.slot or {})["index"]))
    if slot is None:
        emit(f"{handle.step}: cluster {cluster} is left to the step holding its slot (SkyPilot takes "
             f"it down {backend.settings.idle_minutes} min after its last job)")  # fmt: skip
        return
    try:
        record = read_record(path)  # again, now that no one else can change it
        if record is not None and record.get("cluster") == cluster:
            failures = retire(backend, cluster, path)
            if failures:
                raise failures[0]
    finally:
        slot.release()


# ---- How a SkyPilot run's status is read: the worker's own record first, over

# The message of a run the worker's record says goes: its worker has
# started, so SkyPilot no longer holds the job in its queue.
WORKER_RUNNING = "RUNNING (the worker's record)"


def poll(backend: SkypilotBackend, handle: RunHandle) -> RunStatus:
    """The run's status; `worker_started` says whether it is read from the
    worker's record of a run going."""
    ended = _kept(backend, handle)
    if ended is not None:
        return ended
    job_id = SkypilotState.of(handle).job_id
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
    if handle.state.slot is not None:  # kept now: another run's teardown may take the shared cluster down
        with contextlib.suppress(SubstraxError, OSError):
            backend.remote_run(handle).keep_log(backend.run_file(handle, "run.log"))
    backend.save_state(handle, final_status=status.__dict__)
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
    cached = SkypilotState.of(handle).final_status
    if not isinstance(cached, dict):
        with contextlib.suppress(SubstraxError):
            cached = SkypilotState.of(backend.store.read(handle.run_id)).final_status
    return RunStatus(**cached) if isinstance(cached, dict) else None


def worker_record(backend: SkypilotBackend, handle: RunHandle) -> runfiles.StatusAnswer | None:
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
    final = SkypilotState.of(handle).final_status
    if isinstance(final, dict):
        return RunStatus(**final)
    cluster = backend.cluster(handle)
    if SkypilotState.of(handle).cancel_requested:
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
    backend.save_state(handle, final_status=ended.__dict__)
    return ended


def _from_worker(
    backend: SkypilotBackend, handle: RunHandle, status: RunStatus, record: runfiles.StatusAnswer | None
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
