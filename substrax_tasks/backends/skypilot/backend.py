"""The SkyPilot backend: SkyPilot provisions a cluster and bounds its life;
the project's own worker runs every step on it over ssh, as on an ssh host.

A cluster is launched with one SkyPilot task (task.py): COPY file mounts
bring the remote scripts and the first step's snapshot; its setup arms the
cluster's lifetime timer, runs setup_commands and builds the locked
environment; its run is the lease (remote/lease.py), the cluster's one
SkyPilot job, which holds it while steps run and ends idle_minutes after
the last. SkyPilot's autodown, armed at launch with a short idle, then takes
the cluster down, with or without a client.

Every step, the first included, is given a cluster by a claim on its lease,
then runs as on an ssh host over the ssh config SkyPilot writes
(remote_run.py): its files by rsync, its environment by env.py, its worker
started, followed, cancelled and fetched through control.py; no SkyPilot
job per step, and SkyPilot's queue is never read for a step's state. With
`reuse = true` a cluster is kept in a slot of its shape's pool
(slots/skypilot-<shape>/<i>.json) and serves the next step of any doit of
the project while its lease holds it and its lifetime allows.

Every SkyPilot call is one process of helper/sky_sdk.py in SkyPilot's own
interpreter (client.py). State in the handle (state.py, written through
`save_state`): the cluster, its lease job, the run's paths there and the
cluster's lifetime timer;
in the run's folder: task.json (the intent, written before launch) and
launch-request.json (SkyPilot's request id, written the moment it exists).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends import gpus as _gpus
from substrax_tasks.backends import remote_run as _remote_run
from substrax_tasks.backends.base import Backend, Capabilities, Fetched, KeptCheckpoints, Leak, RunStatus
from substrax_tasks.backends.checkpoints import Snapshots, checkpoints_folder
from substrax_tasks.backends.job import env_dir_of
from substrax_tasks.backends.remote_run import DamagedHost, RemoteRun, damage_said
from substrax_tasks.backends.scripts import staged_scripts
from substrax_tasks.backends.skypilot import task as sky_task
from substrax_tasks.backends.skypilot.client import (
    CLUSTER_GONE,
    REQUEST_LIVE,
    LogRelay,
    SkyCallError,
    SkyClient,
    job_state,
)
from substrax_tasks.backends.skypilot.settings import (
    AUTODOWN_MINUTES,
    UNPRICED_CLOUDS,
    SkypilotSettings,
    cloud_of,
)
from substrax_tasks.backends.skypilot.state import SkypilotState
from substrax_tasks.console import emit
from substrax_tasks.errors import BackendError, HostRefused, SubstraxError
from substrax_tasks.interrupts import check_interrupted
from substrax_tasks.slots import Pool
from substrax_tasks.step.spec import canonical_digest, safe_name, settings_in_key
from substrax_tasks.step.view import project_view, written_paths
from substrax_tasks.store import shared_machine
from substrax_tasks.store.cost import watchdog_seconds
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.run_store import RunStore
from substrax_tasks.transports.openssh import ClusterTarget
from substrax_tasks.transports.rsync import RsyncTransport

if sys.version_info < (3, 11):  # pragma: no cover - 3.10 only
    from exceptiongroup import ExceptionGroup

LAUNCH_REQUEST = "launch-request.json"
# How much of the end of a failed setup's log is read (its last 2,000 characters are said).
SETUP_LOG_TAIL_BYTES = 8 << 10
TASK_FILE = "task.json"


def cluster_target(cluster: str) -> ClusterTarget:
    return ClusterTarget(cluster, Path.home() / ".sky" / "generated" / "ssh" / cluster)


def cluster_leaks(backend: SkypilotBackend, handles: list[RunHandle]) -> list[Leak]:
    """Clusters of the prefix that no live handle names. Those a handle of
    the client named, or whose name carries its id, are its own; the rest
    may be another client's (the prefix is shared by default, and so may be
    the project's path), so are listed, never removed. A cluster a slot
    keeps warm is listed as such, with its lease and lifetime left."""
    runs = [h for h in handles if h.backend == backend.name]
    live = {SkypilotState.of(h).cluster for h in runs if not SkypilotState.of(h).torn_down}
    named = {SkypilotState.of(h).cluster for h in runs}
    prefix, client = backend.settings.cluster_prefix, backend.store.client_id()
    warm = warm_records(backend)
    return [
        Leak(backend.name, "SkyPilot", name, name in named or sky_task.made_by(name, prefix, client),
             functools.partial(down_warm, backend, name),
             warm=warm_note(backend, warm[name]) if name in warm else None)
        for name in backend.sky().cluster_names()
        if name.startswith(f"{prefix}-") and name not in live
    ]


def warm_records(backend: SkypilotBackend) -> dict[str, dict[str, Any]]:
    """The clusters the project's slots keep warm, by name."""
    return {str(record["cluster"]): record for _, record in slot_records(backend)}


def slot_records(backend: SkypilotBackend) -> list[tuple[Path, dict[str, Any]]]:
    """Each slot's record of the cluster it keeps warm, with its path."""
    found = []
    for path in backend.store.slots_dir("skypilot").parent.glob("skypilot-*/*.json"):
        record = read_record(path)
        if record is not None and isinstance(record.get("cluster"), str):
            found.append((path, record))
    return found


def down_warm(backend: SkypilotBackend, cluster: str) -> None:
    """A cluster taken down by `gc --machines`, and forgotten by the slot
    that kept it warm: the next doit launches in that slot at once, instead
    of finding the cluster out of reach first. If it was a warm one, its
    life ends now, and with it its last run's cost."""
    backend.sky().down(cluster)
    shared_machine.went_down(life_path(backend, cluster))
    cluster_target(cluster).stop_master()
    for path, record in slot_records(backend):
        if record["cluster"] == cluster:
            path.unlink(missing_ok=True)


def minutes(seconds: float) -> str:
    return f"{max(seconds, 0.0) / 60:.1f} min"


def warm_note(backend: SkypilotBackend, record: dict[str, Any]) -> str:
    """What holds a warm cluster and how long: its lease, as remote/lease.py says, and its lifetime."""
    lifetime = f"{minutes(float(record.get('deadline', 0)) - time.time())} of its lifetime left"
    cluster = str(record["cluster"])
    root = backend.settings.remote_root.rstrip("/")
    if not root.startswith("/"):
        root = f"{record.get('job_home') or '.'}/{root}"
    bin_dir = f"{root}/bin-{record.get('bin_digest')}"
    run = RemoteRun(cluster_target(cluster), backend.settings.python, bin_dir, f"{root}/runs")
    try:
        what = f"asking the lease of cluster {cluster}"
        lease = run.answer(run.checked_script("lease.py", "status", root, cluster, what=what), what)
    except SubstraxError as exc:
        return f"its lease could not be asked ({exc}); {lifetime}"
    if lease.get("state") != "held":
        return f"its lease has ended (SkyPilot's autodown takes it down); {lifetime}"
    busy, idle_left = lease.get("busy") or [], lease.get("idle_left")
    held = (f"its lease holds it for {len(busy)} running step(s)" if busy or idle_left is None else
            f"its lease holds it {minutes(float(idle_left))} more unless a step comes")  # fmt: skip
    return f"{held}; {lifetime}"


class _Claimed(Exception):
    """The cluster was claimed while SkyPilot was being asked: the answer is not needed."""


class SkypilotBackend(Backend):
    name = "skypilot"
    Settings = SkypilotSettings
    State = SkypilotState
    settings: SkypilotSettings
    capabilities = Capabilities(checkpoints=True)

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

    def attempt_file(self, handle: RunHandle, name: str) -> Path:
        """A file of the run's current attempt's launch: the first's as
        ever (task.json), a relaunch's with its number (task-attempt2.json):
        each attempt's intent and request are kept."""
        attempts = len(handle.state.attempts)
        if attempts > 1:
            stem, dot, suffix = name.partition(".")
            name = f"{stem}-attempt{attempts}{dot}{suffix}"
        return self.run_file(handle, name)

    def request_id(self, handle: RunHandle) -> str | None:
        try:
            data = json.loads(self.attempt_file(handle, LAUNCH_REQUEST).read_text())
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

    def there(self, handle: RunHandle) -> sky_task.ClusterLayout:
        """The run's layout where the cluster's job runs (absolute once its home is known)."""
        layout = self.layout(handle)
        if layout.root.startswith("/"):
            return layout
        return sky_task.at_job_home(layout, self.sky(), self.store, handle, self.cluster(handle))

    def reachable(self, handle: RunHandle) -> ClusterTarget:
        """The cluster over the ssh config SkyPilot wrote."""
        target = self.target(handle)
        if not target.config_file.is_file() and target.host not in self._ssh_config_written:
            self._write_ssh_config(handle)  # another machine's launch, or one before an upgrade
        if not target.config_file.is_file():
            raise BackendError(
                f"run {handle.run_id}: no ssh access to cluster {target.host} "
                f"({target.config_file} is missing: the cluster is down, or was launched from another home)"
            )
        return target

    def remote_run(self, handle: RunHandle) -> RemoteRun:
        """The run's folder on the cluster, over the ssh config SkyPilot wrote."""
        target = self.reachable(handle)
        layout = self.there(handle)
        ends = _remote_run.lifetime_end(self.lifetime_left(handle))
        return RemoteRun(target, self.settings.python, layout.bin, layout.run, ends)

    def lease(self, handle: RunHandle, operation: str, *args: str) -> dict[str, Any]:
        """remote/lease.py's answer on the run's cluster."""
        run = self.remote_run(handle)
        what = f"asking the lease of cluster {self.cluster(handle)}"
        root, cluster = self.there(handle).root, self.cluster(handle)
        return run.answer(run.checked_script("lease.py", operation, root, cluster, *args, what=what), what)

    def claim(self, handle: RunHandle) -> dict[str, Any]:
        """The cluster claimed for the run from its lease (lease.py claim).
        With a relative remote_root whose home is not known yet (a new
        cluster), the claim runs in the home the setup wrote where ssh
        lands (sky_task.in_job_home), and its answer names that home, kept
        in the handle: one ssh call, no read of the job's log through
        SkyPilot. {"state": None} while the lease has not started."""
        layout, cluster = self.layout(handle), self.cluster(handle)
        folder = sky_task.run_folder(handle)  # the attempt's: a relaunch's is not the lost one's
        if layout.root.startswith("/") or SkypilotState.of(self.store.read(handle.run_id)).job_home:
            return self.lease(handle, "claim", folder)
        run = RemoteRun(self.reachable(handle), self.settings.python, layout.bin, layout.run)
        what = f"claiming cluster {cluster} from its lease"
        claim = run.script("lease.py", "claim", layout.root, cluster, folder)
        in_home = sky_task.in_job_home(self.settings.python, layout, cluster, claim)
        result = run.ask(in_home, "lease claim", what)
        if result.returncode == sky_task.NO_JOB_HOME:
            return {"claimed": False, "state": None, "no_job_home": True,
                    "reason": "its setup has not begun"}  # fmt: skip
        run.refuse_damaged(result)
        if result.returncode != 0:
            raise result.failure(what, cluster)
        answer = run.answer(result, what)
        home = answer.get("job_home")
        if answer.get("claimed") and isinstance(home, str) and home.startswith("/"):
            self.save_state(handle, job_home=home)
        return answer

    def slot_pool(self, handle: RunHandle) -> Pool | None:
        """max_parallel clusters per shape; with reuse, a slot is a cluster
        steps take turns on, one at a time, kept warm across doits."""
        if self.settings.max_parallel is None:
            return None
        seats = self.settings.seats(dict(handle.spec.resources))  # steps side by side on one cluster
        name = f"skypilot-{shape(self, handle)}" + (f"-x{seats}" if seats > 1 else "")
        limit = self.settings.max_parallel * seats
        resources = self.settings.resources(dict(handle.spec.resources))
        where = "SkyPilot (" + ", ".join(f"{k}={v}" for k, v in sorted(resources.items())) + ")"
        warm = warm_slots(self.store.slots_dir(name), limit, seats) if self.settings.reuse else ()
        return Pool(name, limit, where, shared=self.settings.reuse, prefer=warm)

    # ------------------------------------------------------------- launch
    def launch(self, handle: RunHandle) -> RunHandle:
        """A cluster for the run, claimed through its lease: a warm one of
        the run's slot (reuse), the one a launch request in flight makes
        (a client killed while it waited), or a new one."""
        layout = self.layout(handle)
        handle = self.save_state(handle, remote_run=layout.run, bin_digest=layout.bin_digest)
        with launching(self, handle):  # the slots that share the cluster: one launches it
            return self._launch(handle)

    def relaunch(self, handle: RunHandle) -> RunHandle:
        """A cluster for the run's new attempt once its cluster was lost
        while the command ran (remote_step(..., preemptions=N)). The lost
        one is made sure gone first: `sky.down` (SkyPilot may still hold it
        UP in its record; one it already removed is no error) and its slot's
        record of it dropped; but with reuse, a cluster SkyPilot holds UP
        whose worker alone was lost stays for the steps that share it, only
        the run's tree and folder there removed. Then `launch`, as for a new
        step: a warm cluster of the slot first (reuse), else a new one,
        named apart from the lost one, in a run folder of the attempt's own,
        bounded by a lifetime timer of its own. With use_spot = true and
        on_demand_last_attempt = true, the last attempt preemptions= allow is
        launched on demand, never on a warm spot cluster."""
        lost = SkypilotState.of(handle).cluster
        if isinstance(lost, str) and not SkypilotState.of(handle).torn_down:
            if self.settings.reuse and not cluster_gone(self, lost):
                # The lost attempt's folder: its name counts the attempts before
                # the one just added (run_folder), not the new attempt's.
                before = handle.state.model_copy(update={"attempts": handle.state.attempts[:-1]})
                try:
                    self.remote_run(handle.model_copy(update={"state": before})).remove()
                except BackendError as exc:  # a new attempt beside it would run the command twice
                    raise BackendError(
                        f"run {handle.run_id}: what is left of its lost attempt on cluster {lost} could not "
                        f"be stopped ({exc}); no new attempt starts beside it. Stop those processes there, "
                        f"then run `doit {handle.step}` again"
                    ) from None
            else:
                failures: list[Exception] = []
                if not self.down_cluster(lost, failures):
                    raise failures[0]  # a BackendError: retried as the machinery's (retries)
                forget_cluster(self, handle)
                emit(f"{handle.step}: the lost cluster {lost} is taken down")
        # A relaunch a stopped doit left half done launches afresh: what its launch made is down.
        self.attempt_file(handle, LAUNCH_REQUEST).unlink(missing_ok=True)
        attempt = handle.state.attempts[-1] if handle.state.attempts else None
        on_demand = attempt is not None and attempt.last is True and self.settings.on_demand_last_attempt
        if on_demand:
            number = attempt.number if attempt else 0
            emit(f"{handle.step}: attempt {number} is the last preemptions= allow: "
                 "on an on-demand machine (on_demand_last_attempt = true)")  # fmt: skip
        handle = self.save_state(
            handle, cluster=None, lease_job=None, watchdog=None, job_home=None, remote_run=None,
            bin_digest=None, env_dir=None, gpus=None, outputs_root=None, final_status=None,
            cancel_requested=False, torn_down=False, on_demand=on_demand,
        )  # fmt: skip
        return self.launch(handle)

    def _launch(self, handle: RunHandle) -> RunHandle:
        rid = self.request_id(handle)
        if rid is None and self.settings.reuse and not SkypilotState.of(handle).on_demand:
            warm = warm_cluster(self, handle)
            if warm is not None:
                return warm
        cluster = self.cluster(handle)
        log = self.run_file(handle, "launch.log")
        relay = LogRelay(log, f"{handle.step}: ")
        state = self.sky().request_state(rid) if rid else None
        timer = sky_task.lifetime_timer(self.settings)  # the setup arms it after this: no later
        if rid and state in (*REQUEST_LIVE, "SUCCEEDED"):
            emit(f"{handle.step}: waiting for launch request {rid} of cluster {cluster}")
            request = {"request_id": rid, "log_file": str(log), "cluster_name": cluster,
                       "write_ssh_config": True}  # fmt: skip
            result = self.sky().call("wait_launch", request, timeout=None, while_waiting=relay)
        else:
            result = self._launch_cluster(handle, relay)
        lease_job = result.get("job_id") if isinstance(result, dict) else None
        if not isinstance(lease_job, int):
            raise BackendError(f"run {handle.run_id}: SkyPilot launched {cluster} but submitted no lease job")
        if not isinstance(SkypilotState.of(handle).watchdog, dict):
            handle = self.save_state(handle, watchdog=timer)
        price = result.get("hourly_cost") if isinstance(result, dict) else None
        handle = self.save_state(handle, cluster=cluster, lease_job=lease_job,
                                 hourly_cost=price if isinstance(price, (int, float)) else None)  # fmt: skip
        record_cluster(self, handle)
        if isinstance(result.get("ssh_config"), str):  # the launch's helper wrote it
            self._ssh_config_written.add(cluster)
        else:
            self._write_ssh_config(handle)
        self._claim_when_held(handle)
        # As the claim left it (it may have learnt the home the lease runs
        # in): the slot's record keeps that for the next step on the cluster.
        handle = self.store.read(handle.run_id)
        record_cluster(self, handle)
        return handle

    def _launch_cluster(self, handle: RunHandle, relay: LogRelay) -> Any:
        project = Path(str(handle.state.project))
        layout = self.layout(handle)
        lock, env_dir = sky_task.environment(self.settings, layout, project)
        upload = self.run_file(handle, "upload")
        sky_task.snapshot(self.settings, handle, project, self.store.root, upload / "project")
        cluster = self.cluster(handle)
        config = sky_task.task_config(
            self.settings, handle, layout, cluster=cluster, upload_dir=upload,
            remote_dir=staged_scripts(upload / "bin"), project=project, lock=lock, env_dir=env_dir,
        )  # fmt: skip
        # The intent, before any paid call: what would be launched, and where.
        write_json_atomic(self.attempt_file(handle, TASK_FILE), config)
        handle = self.save_state(handle, cluster=cluster, job_home=None)  # not a warm one tried
        record_cluster(self, handle)  # before the launch: a killed client's cluster is found
        life = self.shared_machine(handle, new=True)
        if life is not None:  # its life begins: the runs that use it share it out
            first = shared_machine.Claim(handle.run_id, asked_at(handle), seat_of(handle))
            shared_machine.launched(life, cluster, self.keep_warm_seconds(handle), first)
        emit(f"{handle.step}: launching cluster {cluster} (SkyPilot; `substrax-compute cancel "
             f"{handle.run_id}` stops it)")  # fmt: skip
        log = self.run_file(handle, "launch.log")
        request = {
            "task": config, "cluster_name": cluster, "down": True, "log_file": str(log),
            "idle_minutes_to_autostop": AUTODOWN_MINUTES, "retry_until_up": self.settings.retry_until_up,
            "request_file": str(self.attempt_file(handle, LAUNCH_REQUEST)), "write_ssh_config": True,
            # SkyPilot checks the task first, in the launch's own helper process
            "validate": sky_task.validation(self.settings),
        }  # fmt: skip
        try:
            return self.sky().call("launch", request, timeout=None, while_waiting=relay)
        except SkyCallError as exc:
            if exc.kind != sky_task.TASK_REFUSED:
                raise
            forget_cluster(self, handle)  # nothing was launched
            self.save_state(handle, cluster=None)
            raise sky_task.refused(self.settings, exc.kind, exc.detail) from None
        except KeyboardInterrupt:
            rid = self.request_id(handle)
            if rid:
                emit(f"\n{handle.step}: launch request {rid} goes on in SkyPilot's API server; "
                     f"`doit {handle.step}` waits for it again, `substrax-compute cancel "
                     f"{handle.run_id}` stops it and takes the cluster down", err=True)  # fmt: skip
            raise

    def _claim_when_held(self, handle: RunHandle) -> RunHandle:
        """Claim the new cluster for this run once its lease holds it (the
        lease starts once the setup has ended): asked over ssh every
        LEASE_WAIT_SECONDS, also while SkyPilot is asked, every
        poll_seconds, whether the setup failed (a helper process that takes
        seconds on a loaded machine: the claim does not wait for it). A
        setup that failed ends the lease's job without a lease: the step
        fails with its log, and the cluster goes."""
        cluster, job_id = self.cluster(handle), SkypilotState.of(handle).lease_job
        assert job_id is not None  # launch() recorded it before this
        answer: dict[str, Any] = {}

        def claimed() -> bool:
            nonlocal answer
            answer = self.claim(handle)
            left = self.lifetime_left(handle)
            if answer.get("state") == "ended" or (left is not None and left <= 0):
                raise BackendError(f"run {handle.run_id}: the lease of cluster {cluster} ended (or its "
                                   "lifetime did) before the run could claim it")  # fmt: skip
            return bool(answer.get("claimed"))

        def claim_while_asked() -> None:
            if claimed():
                raise _Claimed

        next_check = time.monotonic() + self.poll_seconds
        while not claimed():
            check_interrupted()
            time.sleep(LEASE_WAIT_SECONDS)
            if time.monotonic() < next_check:
                continue
            try:
                jobs = self.sky().call("job_status", {"cluster_name": cluster, "job_ids": [job_id]},
                                       while_waiting=claim_while_asked)  # fmt: skip
            except _Claimed:
                break
            next_check = time.monotonic() + self.poll_seconds
            value = (jobs or {}).get(str(job_id))
            if value is not None and job_state(value) != "running":
                self._setup_failed(handle, cluster, job_id, str(value))
            if value == "RUNNING" and answer.get("no_job_home"):
                # The setup ended but wrote no home where ssh lands (a login
                # home it cannot write, or a setup of the release before):
                # it printed it to the job's log.
                sky_task.job_home(self.sky(), self.store, handle, cluster)
        return handle

    def _setup_failed(self, handle: RunHandle, cluster: str, job_id: int, value: str) -> None:
        log = self.run_file(handle, "setup.log")
        with contextlib.suppress(SubstraxError, OSError):
            log.unlink(missing_ok=True)
            self.sky().call("tail_logs", {"cluster_name": cluster, "job_id": job_id, "follow": False,
                                          "output_file": str(log)})  # fmt: skip
        said = ""
        with contextlib.suppress(OSError), log.open("rb") as f:  # its end only, whatever its size
            f.seek(max(0, f.seek(0, 2) - SETUP_LOG_TAIL_BYTES))
            said = f.read().decode(errors="replace").strip()[-2000:]
        failures: list[Exception] = []
        if self.down_cluster(cluster, failures):
            forget_cluster(self, handle)
            self.save_state(handle, torn_down=True)
        # not a BackendError: the step fails, it is not retried
        raise SubstraxError(f"the setup of cluster {cluster} failed (SkyPilot job {value}), so its lease "
                            f"never started and the cluster was taken down:\n{said}")  # fmt: skip

    def setup(self, handle: RunHandle) -> RunHandle:
        """The run's own lifetime timer, with what is left of the cluster's:
        its tree goes when the cluster's lifetime ends (the cluster's setup
        ran once, at launch)."""
        left = self.lifetime_left(handle)
        left = watchdog_seconds(handle, left if left is not None else 0.0, self.settings.grace_seconds)
        seconds = f"{max(left, 1.0):g}"
        self.remote_run(handle).control("watchdog", seconds, what="arming the run's lifetime timer")
        return handle

    def sync(self, handle: RunHandle) -> RunHandle:
        """The step's view of the project and the sources by rsync (a no-op
        for the first step, whose snapshot the launch brought), then its
        environment by env.py (reused while the lock is the same)."""
        project = Path(str(handle.state.project))
        run = self.remote_run(handle)
        there = f"{run.run_dir}/project"
        outputs = {o.rstrip("/") for o in handle.spec.outputs}
        view = project_view(project, self.store.root, handle.spec.inputs, written_paths(handle.spec))
        sources = self.settings.copy_.source_paths() if self.settings.copy_ is not None else []
        bucket = self.settings.bucket
        buckets = {p.strip("/") for p in bucket.buckets} if bucket is not None else set()
        files = [f for f in view.files if f.rstrip("/") not in outputs | set(sources) | buckets]
        transport = RsyncTransport(self.target(handle))
        transport.upload(project, files, there)
        if sources:
            transport.upload(project, sources, there)
        envs = f"{self.there(handle).root}/envs"
        result = run.run_script("env.py", there, envs, self.settings.python, *self.settings.pip_args,
                                what="building the environment", long=True)  # fmt: skip
        if result.returncode != 0:
            raise result.failure("building the environment", self.cluster(handle))
        env_dir = env_dir_of(handle.step, run.answer(result, "building the environment"))
        what = "listing the GPUs"

        def listed() -> dict[str, Any]:
            return run.answer(run.checked_script("gpus.py", what=what), what)

        locks = f"{self.there(handle).root}/gpus"  # the runs on the cluster hold its GPUs there
        gpus = _gpus.job_gpus(handle.spec, False, listed, locks, self.cluster(handle))
        return self.save_state(handle, env_dir=env_dir, left_out=view.left_out, gpus=gpus)

    def start(self, handle: RunHandle) -> RunHandle:
        if not isinstance(SkypilotState.of(handle).lease_job, int):
            raise BackendError(f"run {handle.run_id}: it was never launched")
        run = self.remote_run(handle)
        own = SkypilotState.of(handle)
        there = self.there(handle)
        job = sky_task.worker_job(self.settings, handle, there, own.env_dir, own.left_out,
                                  gpus=own.gpus)  # fmt: skip
        if handle.spec.checkpoints is not None:  # before the worker: the command reads them as it starts
            self._put_checkpoints_in_place(handle, run, there)
        path = f"{run.run_dir}/job.json"
        write = 'umask 077 && cat > "$1.partial" && mv "$1.partial" "$1"'
        run.check(["sh", "-c", write, "sh", path], "writing the job", stdin=json.dumps(job).encode())
        # In the home the lease's SkyPilot job runs in, as SkyPilot would run a
        # task there: the job's "." (the home it hides) and the task's $HOME
        # are that home, not the login's where ssh lands (on Slurm they differ).
        home = SkypilotState.of(self.store.read(handle.run_id)).job_home  # learnt as the paths above were
        _remote_run.start_worker(run, handle, path, job.get("gpus"), self.cluster(handle), home=home)
        return handle

    # -------------------------------------------------------- checkpoints
    def _put_checkpoints_in_place(
        self, handle: RunHandle, run: RemoteRun, there: sky_task.ClusterLayout
    ) -> None:
        """The step's latest snapshot in its kept folder on the cluster: from
        the bucket (bucket transport: the cluster pushed it there), else
        from the store here (as on an ssh host)."""
        if self.settings.bucket is not None:
            dest = there.checkpoints_in_bucket(self.store.client_id(), handle.step, checkpoint_key(handle))
            _remote_run.restore_from_bucket(run, dest, there.checkpoints_kept, handle.step)
            return
        snapshots = self.snapshots(handle)
        if snapshots is not None:
            _remote_run.push_checkpoints(run, RsyncTransport(self.target(handle)).upload, snapshots,
                                         there.checkpoints_kept, handle.step)  # fmt: skip

    def snapshots(self, handle: RunHandle) -> Snapshots | None:
        folder = checkpoints_folder(self.store, handle)
        return None if folder is None else Snapshots(folder)

    def checkpoint_puller(self, handle: RunHandle) -> _remote_run.Checkpointing | None:
        """What takes the run's snapshots while it runs: pushed from the
        cluster into the bucket (bucket transport), else pulled home."""
        if handle.spec.checkpoints is None or SkypilotState.of(handle).torn_down:
            return None
        run, every = self.remote_run(handle), self.settings.checkpoint_seconds
        bound = _remote_run.SnapshotBound(self.settings.max_checkpoint_size, "skypilot")
        if self.settings.bucket is not None:
            dest = self.there(handle).checkpoints_in_bucket(self.store.client_id(), handle.step,
                                                            checkpoint_key(handle))  # fmt: skip
            return _remote_run.BucketCheckpointPusher(run, every, handle.step, dest, bound)
        snapshots = self.snapshots(handle)
        assert snapshots is not None  # the step has checkpoints
        quiet = RsyncTransport(self.target(handle), quiet=True)
        return _remote_run.CheckpointPuller(run, quiet, snapshots, every, handle.step, bound)

    def checkpoints_kept_elsewhere(self) -> list[KeptCheckpoints]:
        """With the bucket transport: this client's snapshot folders in the
        outputs bucket (another client's, of a step of the same name, are
        not ours to list or remove)."""
        if self.settings.bucket is None:
            return []
        from substrax_tasks.transports.bucket import BucketTransport

        bucket = BucketTransport()
        root = f"{self.settings.bucket.outputs_bucket}/{sky_task.checkpoints_of(self.store.client_id())}"
        return [
            KeptCheckpoints(step, key, f"{root}/{step}/{key}",
                            functools.partial(bucket.remove_tree, f"{root}/{step}/{key}"))
            for step in bucket.folders(root) for key in bucket.folders(f"{root}/{step}")
        ]  # fmt: skip

    def remove_checkpoints(self, handle: RunHandle) -> None:
        if self.settings.bucket is None:
            return
        from substrax_tasks.transports.bucket import BucketTransport

        mine = sky_task.checkpoints_of(self.store.client_id())
        BucketTransport().remove_tree(f"{self.settings.bucket.outputs_bucket}/{mine}/{safe_name(handle.step)}")

    def keep_last_checkpoints(self, handle: RunHandle) -> None:
        if not isinstance(SkypilotState.of(handle).launched_job, int):
            return
        try:
            puller = self.checkpoint_puller(handle)
        except BackendError as exc:
            emit(f"{handle.step}: the last checkpoints were not kept: {exc}", err=True)
            return
        _remote_run.pull_as_ended(puller, handle.step)

    # ------------------------------------------------------------- status
    def poll(self, handle: RunHandle) -> RunStatus:
        """The worker's record, read over ssh. `lost` only when the worker
        is dead with no final status (its record says so), or when its
        record cannot be read and SkyPilot, asked to refresh from the cloud,
        says the cluster is gone or not UP: a cluster taken away (a spot
        preemption, a Slurm allocation ended) is told apart from a slow
        one. A read that failed or timed out on a cluster SkyPilot holds UP,
        or SkyPilot not answering, raises BackendError as an ssh host out of
        reach does: the run goes on there and is reattached, never relaunched.

        Measured on the Slurm bed (SkyPilot 0.14.1, `scancel` of the job
        that holds a cluster, the command running): the command and the
        lease die at once with the job; ssh to the cluster fails at once
        (exit 255, "kex_exchange_identification: Connection closed by remote
        host", 1.3-2.4 s a try, through SkyPilot's proxy into the job);
        `sky.status` without a refresh still says UP 15 s later, while a
        refresh (AUTO or FORCE) answers in 0.2-0.8 s with no record: the
        cluster is removed, its ssh config with it."""
        ended = _kept(self, handle)
        if ended is not None:
            return ended
        if not isinstance(SkypilotState.of(handle).launched_job, int):
            return _launch_status(self, handle)
        cluster = self.cluster(handle)
        try:
            return _remote_run.worker_status(self, handle, self.remote_run(handle), cluster)
        except HostRefused:
            raise
        except BackendError as exc:
            if not cluster_gone(self, cluster):
                raise
            with contextlib.suppress(SubstraxError):
                handle = self.store.read(handle.run_id)
            final = SkypilotState.of(handle).final_status
            if isinstance(final, dict):  # the canceller's record, written as the cluster went
                return RunStatus(**final)
            if SkypilotState.of(handle).cancel_requested:
                return RunStatus("cancelled", message=f"cancelled; its cluster {cluster} was taken down")
            gone = (f"its cluster {cluster} is gone: SkyPilot, asked the cloud, no longer holds it "
                    "(preempted, its allocation ended, torn down, or its lifetime ran out)")  # fmt: skip
            return RunStatus("lost", message=f"{gone}; its run could not be read: {str(exc)[:300]}")

    # ------------------------------------------------------------- cancel
    def cancel(self, handle: RunHandle) -> bool:
        """A launch in flight: its request cancelled and its cluster taken
        down, every step attempted and the failures raised together as an
        ExceptionGroup. A run: its tree stopped (control.py cancel); the
        cluster, if it is the run's own (reuse = false), taken down."""
        status = self.poll(handle)
        if status.final and status.state != "lost":
            return False
        # Told first: a client waiting on the run reads the cluster going as the cancel it is.
        handle = self.save_state(handle, cancel_requested=True)
        cluster = self.cluster(handle)
        failures: list[Exception] = []
        if not isinstance(SkypilotState.of(handle).launched_job, int):
            self._cancel_launch(handle, cluster)
            return True
        if status.state == "lost" and cluster_gone(self, cluster):
            return False
        run = self.remote_run(handle)
        grace, stopped = self.settings.grace_seconds, True
        try:
            stopped = _remote_run.cancel_worker(self, handle, run, status, where=cluster, grace_seconds=grace)
        except SubstraxError as exc:
            if self.settings.reuse:  # the cluster is not the run's to take down: nothing else to try
                raise
            failures.append(exc)
        if not self.settings.reuse:  # the run's own cluster: nothing else will use it
            with contextlib.suppress(SubstraxError, OSError):
                run.keep_log(self.run_file(handle, "run.log"))
            if handle.spec.checkpoints is not None:  # the next run starts from what it wrote last
                self.keep_last_checkpoints(handle)
            if self.down_cluster(cluster, failures):
                self.save_state(handle, torn_down=True)
                if SkypilotState.of(self.store.read(handle.run_id)).final_status is None:
                    ended = RunStatus("cancelled", message="cancelled; its cluster was taken down")
                    self.save_state(handle, final_status=ended.__dict__)
        if failures:
            raise ExceptionGroup(f"run {handle.run_id}: {len(failures)} cancel step(s) failed", failures)
        return stopped

    def _cancel_launch(self, handle: RunHandle, cluster: str) -> None:
        """The launch request, if still in flight, and the cluster it makes."""
        failures: list[Exception] = []
        rid = self.request_id(handle)
        if rid is not None:
            try:
                if self.sky().request_state(rid) in REQUEST_LIVE:
                    self.sky().call("api_cancel", {"request_ids": [rid]})
            except SubstraxError as exc:
                failures.append(BackendError(f"cancelling launch request {rid}: {exc}"))
        if self.down_cluster(cluster, failures):
            forget_cluster(self, handle)
            ended = RunStatus("cancelled", message="cancelled; its cluster was taken down")
            self.save_state(handle, final_status=ended.__dict__, torn_down=True)
        if failures:
            raise ExceptionGroup(f"run {handle.run_id}: {len(failures)} cancel step(s) failed", failures)

    def down_cluster(self, cluster: str, failures: list[Exception]) -> bool:
        try:
            self.sky().down(cluster)
        except SubstraxError as exc:
            failures.append(BackendError(f"taking cluster {cluster} down: {exc}"))
            return False
        cluster_target(cluster).stop_master()
        shared_machine.went_down(life_path(self, cluster))  # a warm cluster's life ends: its last run's too
        return True

    def leaks(self, project: str, handles: list[RunHandle]) -> list[Leak]:
        return cluster_leaks(self, handles)

    # --------------------------------------------------------------- logs
    def read_log(self, handle: RunHandle, offset: int) -> bytes:
        kept = _remote_run.read_kept_log(self.run_file(handle, "run.log"), offset)
        if kept is not None:
            return kept
        if not isinstance(SkypilotState.of(handle).launched_job, int) or SkypilotState.of(handle).torn_down:
            return b""
        try:
            return self.remote_run(handle).read_log(offset)
        except BackendError:
            return b""

    @property
    def poll_seconds(self) -> float:
        return self.settings.poll_seconds  # each read before the run goes may be a process that imports sky

    def stream_log(
        self, handle: RunHandle, out: IO[bytes], follow: bool = False, offset: int = 0
    ) -> RunStatus:
        """With follow, one follower on the cluster streams the log until
        the run ends (_remote_run.follow_log), as on an ssh host."""
        status = self.poll(handle)
        if not follow or not isinstance(SkypilotState.of(handle).launched_job, int):
            return super().stream_log(handle, out, follow=follow, offset=offset)
        puller = self.checkpoint_puller(handle)
        if status.final:  # ended before it was followed: its checkpoints are kept all the same
            status = super().stream_log(handle, out, follow=follow, offset=offset)
        else:
            status = _remote_run.follow_log(self, handle, out, offset, self.remote_run(handle), puller)
        if status.state in ("failed", "timed_out", "cancelled"):
            # What the command left as it ended is whole now: the next run starts from it.
            _remote_run.pull_as_ended(puller, handle.step)
        return status

    # -------------------------------------------------------------- fetch
    def fetch(self, handle: RunHandle) -> Fetched:
        staging = self.run_file(handle, "fetched")
        if self.settings.bucket is None:  # copy: as the SSH backend fetches, over SkyPilot's ssh config
            transport = RsyncTransport(self.target(handle))
            return self.remote_run(handle).fetch(transport, list(handle.spec.outputs), staging,
                                                 SkypilotState.of(handle).outputs_root)  # fmt: skip
        from substrax_tasks.transports.bucket import BucketTransport

        run_folder = f"{self.settings.bucket.outputs_bucket}/{self.layout(handle).folder}"
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

    def lifetime_seconds(self) -> float | None:
        return self.settings.transport.lifetime_minutes * 60

    def shared_machine(self, handle: RunHandle, *, new: bool = False) -> Path | None:
        """A reused cluster's life, shared out among the runs that claim it
        (`new`: for a cluster about to be launched)."""
        cluster = SkypilotState.of(handle).cluster
        if not self.settings.reuse or not isinstance(cluster, str):
            return None
        path = life_path(self, cluster)
        return path if new or path.is_file() else None

    def keep_warm_seconds(self, handle: RunHandle) -> float:
        return self.settings.idle_minutes * 60 if self.settings.reuse else 0.0

    def machine_share(self, handle: RunHandle) -> float:
        """A reused cluster's GPUs shared out among steps side by side: each holds one seat of it."""
        return 1.0 / self.settings.seats(dict(handle.spec.resources))

    def hourly_price(self, handle: RunHandle) -> float | None:
        """SkyPilot's catalog price: of the cluster the run was given, as
        the launch priced it (kept with a warm cluster for the runs that
        claim it). Before the launch: the warm cluster's of the run's slot;
        else, for a step with a cap only (whose price must be known before
        anything is paid for), the resources' asked of SkyPilot, when its
        catalog can price them (a cloud that has prices, and an instance
        type). A step without a cap pays no call: its price is said once
        its cluster is up."""
        own = SkypilotState.of(handle)
        if isinstance(own.lease_job, int):
            return own.hourly_cost
        warm = read_record(record_path(self, handle))
        if warm is not None and isinstance(warm.get("hourly_cost"), (int, float)):
            return float(warm["hourly_cost"])
        resources = self.settings.resources(dict(handle.spec.resources))
        if self.settings.max_cost is None:
            return None
        if cloud_of(resources.get("infra")) in (None, *UNPRICED_CLOUDS) or not resources.get("instance_type"):
            return None
        answer = self.sky().call("hourly_price", {"resources": resources})
        price = answer.get("hourly_cost") if isinstance(answer, dict) else None
        return float(price) if isinstance(price, (int, float)) and price > 0 else None

    def outputs_available(self, handle: RunHandle) -> bool:
        if self.settings.bucket is not None:
            from substrax_tasks.transports.bucket import BucketTransport

            try:
                BucketTransport().read_manifest(
                    f"{self.settings.bucket.outputs_bucket}/{self.layout(handle).folder}/manifest.json"
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
        if self.settings.reuse:  # a warm cluster steps take turns on: only this run goes
            return f"stopped it and removed its folder {run.run_dir} on cluster {cluster}"
        failures: list[Exception] = []
        if not self.down_cluster(cluster, failures):
            raise failures[0]
        return f"stopped it and took its cluster {cluster} down"

    def teardown(self, handle: RunHandle, *, force: bool = False) -> None:
        """The run's folder removed (a copy of its log kept here); the
        cluster taken down if it is the run's own, or if asked (`force`:
        `substrax-compute teardown`). A reused cluster stays warm for its
        lease's idle_minutes: doit ending does not take it down."""
        shutil.rmtree(self.run_file(handle, "fetched"), ignore_errors=True)  # as the ssh backend
        if not isinstance(SkypilotState.of(handle).cluster, str):
            return  # never launched: nothing was made
        cluster = self.cluster(handle)
        if SkypilotState.of(handle).torn_down:  # the cluster too is gone, unless kept warm in its slot
            if force and holds_cluster(self, handle):
                self._down_and_forget(handle, cluster)
            return
        if not isinstance(SkypilotState.of(handle).launched_job, int):
            self._down_and_forget(handle, cluster)  # a launch that never finished
            return
        try:
            running, damaged = not self.poll(handle).final, False
        except DamagedHost:  # its scripts were changed there: nothing on it is run, it goes down whole
            running, damaged = False, True
        if running:
            try:
                self.cancel(handle)
            except ExceptionGroup as group:  # one message for doit and the CLI alike
                raise BackendError("; ".join(str(e) for e in group.exceptions)) from None
            handle = self.store.read(handle.run_id)
            if SkypilotState.of(handle).torn_down:
                return
        if not damaged and self._let_go_of_warm(handle, force=force):
            return
        if self.settings.reuse and not (force or damaged) and not cluster_gone(self, cluster):
            raise BackendError(f"run {handle.run_id}: its folder on cluster {cluster} could not be "
                               f"removed; `substrax-compute teardown {handle.run_id}` takes the cluster "
                               "down")  # fmt: skip
        self._down_and_forget(handle, cluster)

    def _let_go_of_warm(self, handle: RunHandle, *, force: bool) -> bool:
        """Keep the run's log here and, on a warm cluster (unless `force`),
        remove its folder there and record its release: True when that was
        done. A full disk here is raised, to be said as one, not as the
        cluster's fault; anything else leaves it to the caller."""
        try:
            run = self.remote_run(handle)
            run.keep_log(self.run_file(handle, "run.log"))
            if self.settings.reuse and not force:
                run.remove()
                self.save_state(handle, torn_down=True)
                life = self.shared_machine(handle)
                if life is not None:  # the cluster's keep-warm from now on is this run's, if last
                    shared_machine.released(life, handle.run_id)
                return True
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
        except SubstraxError:
            pass
        return False

    def _down_and_forget(self, handle: RunHandle, cluster: str) -> None:
        failures: list[Exception] = []
        if not self.down_cluster(cluster, failures):
            raise failures[0]
        forget_cluster(self, handle)
        self.save_state(handle, torn_down=True)


# ---- SkyPilot clusters reused across steps and doits (`reuse = true`).

# A step is given a warm cluster only if, beyond its timeout, this much of
# the cluster's lifetime is left: for the sync before it and the fetch after.
MARGIN_SECONDS = 120.0
# How often a new cluster's lease is asked for while its setup runs, and
# how often a run waiting for another to launch their cluster looks up.
LEASE_WAIT_SECONDS = 0.5
LOG_POLL = 0.5


def checkpoint_key(handle: RunHandle) -> str:
    """The key a run's snapshots are kept by: a changed command or input starts fresh."""
    return str(handle.state.key or handle.spec_digest)


def shape(backend: SkypilotBackend, handle: RunHandle) -> str:
    """Steps of one shape may share a cluster: same settings, same resources."""
    resources = backend.settings.resources(dict(handle.spec.resources))
    return canonical_digest({"settings": settings_in_key(handle.settings), "resources": resources})[:12]


def record_path(backend: SkypilotBackend, handle: RunHandle) -> Path | None:
    """The record of the cluster of the run's slot (reuse only): slots
    i * seats .. (i + 1) * seats - 1 share cluster i."""
    slot = handle.state.slot
    if not isinstance(slot, dict) or not backend.settings.reuse:
        return None
    seats = backend.settings.seats(dict(handle.spec.resources))
    return backend.store.slots_dir(str(slot["pool"])) / f"{int(slot['index']) // seats}.json"


@contextlib.contextmanager
def launching(backend: SkypilotBackend, handle: RunHandle) -> Iterator[None]:
    """Held while a run finds or launches the cluster of its slot, when
    slots share one (seats): the first launches it, the others wait, then
    find it warm."""
    path = record_path(backend, handle)
    if path is None or backend.settings.seats(dict(handle.spec.resources)) == 1:
        yield
        return
    from filelock import FileLock, Timeout

    lock = FileLock(str(path.with_suffix(".launch.lock")), thread_local=False, is_singleton=False)
    while True:
        try:
            lock.acquire(timeout=LOG_POLL)
            break
        except Timeout:
            check_interrupted()  # Ctrl-C in a doit thread ends the wait
    try:
        yield
    finally:
        lock.release(force=True)


# A slot's record of its warm cluster (record_cluster): each key and the types it may hold.
SLOT_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "cluster": (str,), "deadline": (int, float), "run_id": (str,), "bin_digest": (str, type(None)),
    "lease_job": (int, type(None)), "job_home": (str, type(None)), "hourly_cost": (int, float, type(None)),
}  # fmt: skip


def read_record(path: Path | None) -> dict[str, Any] | None:
    """A slot's record of its warm cluster; None when there is none, or
    it is damaged (unreadable, or a key of a type record_cluster never writes)."""
    try:
        record = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or any(
        not isinstance(record.get(key), types) or isinstance(record.get(key), bool)
        for key, types in SLOT_RECORD_TYPES.items()
    ):
        return None
    return record


def set_aside_damaged(path: Path, step: str) -> None:
    """A slot record there but damaged: kept under a name of its own and
    said, so that the slot launches a cluster anew instead of failing on it
    (the cluster it named, if any, is left to `gc --machines` and its lease)."""
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    with contextlib.suppress(FileNotFoundError):
        path.replace(aside)
        emit(f"{step}: the record of its slot's warm cluster {path} was damaged: moved aside to "
             f"{aside}; launching a cluster anew (`substrax-compute gc --machines` takes down the one "
             "it named)")  # fmt: skip


def warm_slots(folder: Path, limit: int, seats: int) -> tuple[int, ...]:
    """The slots whose cluster is up: tried first, so a step waits for a warm one."""
    return tuple(i for i in range(limit) if (folder / f"{i // seats}.json").is_file())


def record_cluster(backend: SkypilotBackend, handle: RunHandle) -> None:
    """The slot's cluster, as the run that launched it knows it: before
    the launch (its deadline counted from then), and once its lease job is known."""
    path = record_path(backend, handle)
    if path is None:
        return
    timer = SkypilotState.of(handle).watchdog
    deadline = (float(timer["armed_at"]) + float(timer["seconds"]) if isinstance(timer, dict)
                else sky_task.lifetime_timer(backend.settings)["seconds"] + time.time())  # fmt: skip
    write_json_atomic(path, {
        "cluster": backend.cluster(handle), "deadline": deadline, "run_id": handle.run_id,
        "bin_digest": SkypilotState.of(handle).bin_digest, "lease_job": SkypilotState.of(handle).lease_job,
        "job_home": SkypilotState.of(handle).job_home, "hourly_cost": SkypilotState.of(handle).hourly_cost,
    })  # fmt: skip


def holds_cluster(backend: SkypilotBackend, handle: RunHandle) -> bool:
    """Whether the run's slot still keeps the run's cluster warm."""
    record = read_record(record_path(backend, handle))
    return record is not None and record.get("cluster") == backend.cluster(handle)


def forget_cluster(backend: SkypilotBackend, handle: RunHandle) -> None:
    """The slot no longer holds the run's cluster (it was taken down)."""
    path = record_path(backend, handle)
    if path is not None and holds_cluster(backend, handle):
        path.unlink(missing_ok=True)


def warm_cluster(backend: SkypilotBackend, handle: RunHandle) -> RunHandle | None:
    """The run, given the warm cluster of its slot, claimed through its
    lease; None when there is none it may use (then one is launched in the
    slot). A cluster whose lease ended goes by itself (SkyPilot's autodown);
    one too short of lifetime or out of reach is taken down (the slot is
    held: no other step uses it)."""
    path = record_path(backend, handle)
    record = read_record(path)
    if path is not None and record is None and path.exists():
        set_aside_damaged(path, handle.step)
    if path is None or record is None or not isinstance(record.get("lease_job"), int):
        return None
    cluster = str(record["cluster"])
    left = float(record.get("deadline", 0)) - time.time()
    reason, down = not_fit_for(record, handle, left), True
    if reason is None:
        timer = {"armed_at": time.time(), "seconds": left}  # the cluster's lifetime, counted from its launch
        warm = backend.save_state(handle, cluster=cluster, lease_job=record["lease_job"], watchdog=timer,
                                  job_home=record.get("job_home"),
                                  hourly_cost=record.get("hourly_cost"))  # fmt: skip
        try:
            answer = backend.claim(warm)
        except HostRefused as exc:
            # Nothing of the run is on it: the run holds no cluster, and the
            # cluster stays in its slot (refused again) until gc --machines.
            backend.save_state(handle, cluster=None, lease_job=None, watchdog=None, job_home=None,
                               hourly_cost=None)  # fmt: skip
            raise refused_warm(cluster, exc) from None
        except SubstraxError as exc:
            answer = {"claimed": False, "reason": f"out of reach: {exc}"}
        if answer.get("claimed"):
            emit(f"{handle.step}: on warm cluster {cluster} (`substrax-compute cancel {handle.run_id}` "
                 "stops this step only)")  # fmt: skip
            warm = backend.store.read(handle.run_id)  # as the claim left it (the home it may have learnt)
            life = backend.shared_machine(warm)
            if life is not None:  # its piece of the cluster's life begins: the one before it ends
                shared_machine.claimed(life, handle.run_id, asked_at(handle), seat_of(handle),
                                       backend.keep_warm_seconds(handle))  # fmt: skip
            if record.get("job_home") is None and SkypilotState.of(warm).job_home is not None:
                record_cluster(backend, warm)
            return warm
        reason = str(answer.get("reason"))
        down = answer.get("state") != "ended"  # an ended lease: SkyPilot's autodown takes it
    emit(f"{handle.step}: not reusing cluster {cluster} ({reason}); launching a new one")
    failures: list[Exception] = []
    if down:
        backend.down_cluster(cluster, failures)
    for failure in failures:
        emit(f"{handle.step}: {failure}", err=True)
    path.unlink(missing_ok=True)
    backend.save_state(handle, cluster=None, lease_job=None, watchdog=None, job_home=None)
    return None


def not_fit_for(record: dict[str, Any], handle: RunHandle, left: float) -> str | None:
    """Why the warm cluster of `record`, with `left` seconds of its lifetime,
    may not take the run (None: it may)."""
    timeout = handle.spec.timeout
    if record.get("bin_digest") != SkypilotState.of(handle).bin_digest:
        return "its scripts are not this release's"
    if timeout is None:
        return "the step has no timeout, so no lifetime left is known to be enough"
    if left < timeout + MARGIN_SECONDS:
        return f"{max(left, 0) / 60:.0f} min of its lifetime left, too few for the step's timeout"
    return None


def refused_warm(cluster: str, exc: HostRefused) -> HostRefused:
    """A warm cluster whose scripts were changed, or whose lease's answer
    passed its bound: refused by name, with the fix that runs nothing on it."""
    what = str(exc)
    if isinstance(exc, DamagedHost):
        what = damage_said(exc.scripts, "there")
    return HostRefused(
        f"warm cluster {cluster} is refused: {what}; it is damaged or tampered with, and nothing is run "
        "on it. `substrax-compute gc --machines` takes it down through SkyPilot (running nothing on it), "
        "and the next doit launches a new one"
    )


def cluster_gone(backend: SkypilotBackend, cluster: str) -> bool:
    """Whether SkyPilot says the cluster is gone or going (not UP), once
    refreshed from the cloud: its own record says UP long after a cluster
    was taken away behind its back (see SkypilotBackend.poll). A SkyPilot
    that does not answer raises BackendError: nothing is known."""
    try:
        records = backend.sky().call("cluster_status", {"cluster_names": [cluster], "refresh": True})
    except SkyCallError as exc:
        return exc.kind in CLUSTER_GONE
    found = [r for r in records or [] if isinstance(r, dict) and r.get("name") == cluster]
    gone = not found or found[0].get("status") != "UP"
    if gone:  # its autodown, or something else, took it: its life ended by now
        shared_machine.went_down(life_path(backend, cluster), seen=True)
    return gone


def life_path(backend: SkypilotBackend, cluster: str) -> Path:
    """The record of a warm cluster's life and the runs that used it (kept after it goes: their cost)."""
    return backend.store.machine_life(cluster)


def asked_at(handle: RunHandle) -> float:
    """When the run asked for its machine (its cost counts from then), else now."""
    record = handle.state.machine
    at = record.get("asked_at") if isinstance(record, dict) else None
    return float(at) if isinstance(at, (int, float)) else time.time()


def seat_of(handle: RunHandle) -> int:
    """The run's seat on its cluster: its slot (slots that share a cluster each hold one of its seats)."""
    slot = handle.state.slot
    return int(slot["index"]) if isinstance(slot, dict) else 0


def _kept(backend: SkypilotBackend, handle: RunHandle) -> RunStatus | None:
    """The final status kept in the handle. A caller's copy may predate the
    end: once the cluster is down, the store's record is all that tells it."""
    cached = SkypilotState.of(handle).final_status
    if not isinstance(cached, dict):
        with contextlib.suppress(SubstraxError):
            cached = SkypilotState.of(backend.store.read(handle.run_id)).final_status
    return RunStatus(**cached) if isinstance(cached, dict) else None


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
