"""SkyPilot clusters reused across steps (`reuse = true`).

Steps whose backend settings and resources are the same (one *shape*) share
a pool of at most `max_parallel` clusters: slot i of the pool (slots.py) is
cluster i, and a step holds the slot while its run goes, so one run at a
time uses a cluster. Its record, `<slot>.json` beside the slot's lock, names
the cluster, the time its lifetime ends and the run that launched it. The
first step in a slot launches the cluster; the next ones find it warm and
queue their job with `sky.exec` (setup done already: the scripts and the
environment are there), after rsync brought their inputs and project
snapshot over the ssh config SkyPilot wrote, to the home the cluster's jobs
run in: a queued job runs no setup, so never prints it (sky_task.job_home);
the launching run's job did, and the record keeps it once asked.

Who takes a shared cluster down: the teardown of a run (as doit ends, or
`substrax-compute teardown`) when no step holds the cluster's slot; else
SkyPilot's autodown, `idle_minutes` after its last job (armed at launch);
and no job on it outlives its lifetime, each arming the watchdog with the
time left. `cancel` of a run cancels its job only.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from substrax_tasks.atomic import write_json_atomic
from substrax_tasks.backends.remote_run import forwarded_env
from substrax_tasks.backends.skypilot import task as sky_task
from substrax_tasks.backends.skypilot.client import CLUSTER_GONE, LogRelay, SkyCallError
from substrax_tasks.console import emit
from substrax_tasks.errors import SubstraxError
from substrax_tasks.step.spec import canonical_digest, settings_in_key
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.transports.rsync import RsyncTransport

if TYPE_CHECKING:
    from substrax_tasks.backends.skypilot.backend import SkypilotBackend

# A job is queued on a warm cluster only if, beyond its timeout, this much of
# the cluster's lifetime is left: for the sync before it and the fetch after.
MARGIN_SECONDS = 120.0


def shape(backend: SkypilotBackend, handle: RunHandle) -> str:
    """Steps of one shape may share a cluster: same settings, same resources."""
    resources = backend.settings.resources(dict(handle.spec.resources))
    return canonical_digest({"settings": settings_in_key(handle.settings), "resources": resources})[:12]


def record_path(backend: SkypilotBackend, handle: RunHandle) -> Path | None:
    slot = handle.state.get("slot")
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
    bin_digest = handle.state.get("bin_digest")
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
    if record.get("bin_digest") != handle.state.get("bin_digest") or record.get("env_dir") != env_dir:
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
    handle = backend.store.update_state(handle, cluster=cluster, watchdog=timer, **home)
    layout = backend.layout(handle)
    there = sky_task.at_job_home(layout, backend.sky(), backend.store, handle, cluster)
    emit(f"{handle.step}: queued on warm cluster {cluster} (SkyPilot exec; `substrax-compute cancel "
         f"{handle.run_id}` cancels this job only)")  # fmt: skip
    try:
        transport = RsyncTransport(backend.target(handle))
        transport.upload(upload, ["in", "project"], there.run)
        sources = backend.settings.copy_.source_paths() if backend.settings.copy_ is not None else []
        if sources:
            transport.upload(Path(str(handle.state["project"])), sources, there.project)
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
    from substrax_tasks.driver.slots import try_take

    path = record_path(backend, handle)
    cluster = backend.cluster(handle)
    record = read_record(path)
    if path is None or record is None or record.get("cluster") != cluster:
        return  # the step that replaced it in the slot took it down
    slot = try_take(path.parent, int(handle.state["slot"]["index"]))
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
