"""What the fake's API server does to clusters and their jobs, on this
machine: a cluster is a folder (its home, file mounts copied in), a job is
`bash -c` of the task's setup, then its run, in a session of its own.

    launch      INIT record -> FAKESKY_LAUNCH_DELAY -> file mounts -> UP ->
                ssh config -> job submitted (INIT) -> autostop armed
    job         [PENDING behind earlier jobs, with FAKESKY_QUEUE_JOBS] ->
                SETTING_UP (setup) -> RUNNING (run) -> SUCCEEDED / FAILED /
                FAILED_SETUP; CANCELLED by cancel/down; FAILED_DRIVER if its
                process died without saying how the job ended
    autostop    a timer process downs (or stops) the cluster once no job has
                run for idle_minutes (a minute is FAKESKY_MINUTE_SECONDS)
    down        jobs killed, timer stopped, every process with the cluster's
                marker killed, the folder and ssh config removed
    preempt     (a test's `python -m sky preempt STATE NAME`) every process
                of the cluster killed, its ssh connections closed, ssh to it
                failing; it reads UP until a status refresh removes it
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from sky import clouds, exceptions
from sky._state import (
    FAKE_ROOT,
    MARKER,
    alive,
    env_float,
    kill_marked,
    locked,
    own_ticks,
    read_json,
    remember_cluster_id,
    sessions_serving,
    spawn,
    state_dir,
    stop_group,
    write_json,
)
from sky._types import ClusterStatus, JobStatus
from sky.task import Resources, Task, is_cloud_url

_CLUSTER_NAME = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")
_F = clouds.CloudImplementationFeatures


def _say(message: str) -> None:
    """A line of the request's log (the request process's stdout)."""
    print(message, flush=True)


# ------------------------------------------------------------------ records


def cluster_dir(state: Path, name: str) -> Path:
    return state / "clusters" / name


def load(state: Path, name: str) -> dict[str, Any] | None:
    record: dict[str, Any] | None = read_json(cluster_dir(state, name) / "cluster.json")
    return record


def _save(state: Path, record: dict[str, Any]) -> None:
    record["status_updated_at"] = int(time.time())
    write_json(cluster_dir(state, record["name"]) / "cluster.json", record)


def _lock(state: Path, name: str) -> Any:
    return locked(state, f"cluster-{name}")


def job_file(state: Path, name: str, job_id: int) -> Path:
    return cluster_dir(state, name) / "jobs" / f"{job_id}.json"


def job_log(state: Path, name: str, job_id: int) -> Path:
    return cluster_dir(state, name) / "jobs" / f"{job_id}.log"


def jobs(state: Path, name: str) -> list[dict[str, Any]]:
    found = [read_json(p) for p in (cluster_dir(state, name) / "jobs").glob("*.json")]
    return sorted((j for j in found if j), key=lambda j: int(j["job_id"]))


def job_status(job: dict[str, Any]) -> JobStatus:
    """The recorded status; FAILED_DRIVER when the job's process is gone
    without having recorded an end (killed from outside)."""
    status = JobStatus(job["status"])
    if not status.is_terminal() and job.get("pid") and not alive(job["pid"], job.get("ticks")):
        return JobStatus.FAILED_DRIVER
    return status


def require(state: Path, name: str, operation: str) -> dict[str, Any]:
    """The cluster's record; ClusterDoesNotExist / ClusterNotUpError as SkyPilot says them."""
    record = load(state, name)
    if record is None:
        raise exceptions.ClusterDoesNotExist(f"Cluster {name!r} does not exist.")
    if record["status"] != ClusterStatus.UP.value:
        raise exceptions.ClusterNotUpError(
            f"{operation.capitalize()}: skipped for cluster {name!r} (status: {record['status']}). "
            "It is only allowed for UP clusters.",
            cluster_status=ClusterStatus(record["status"]),
        )
    return record


def remote_path(state: Path, name: str, destination: str) -> Path:
    """A destination on the cluster: `~/x` (and relative paths) in its home."""
    home = cluster_dir(state, name) / "home"
    if destination == "~":
        return home
    if destination.startswith("~/"):
        return home / destination[2:]
    return Path(destination) if destination.startswith("/") else home / destination


# ------------------------------------------------------------------- launch


def launch(state: Path, task_config: dict[str, Any], cluster_name: str, *,
           idle_minutes_to_autostop: int | None = None, down: bool = False,
           dryrun: bool = False, no_setup: bool = False) -> list[Any]:  # fmt: skip
    if not _CLUSTER_NAME.fullmatch(cluster_name):
        raise exceptions.InvalidClusterNameError(
            f"Cluster name {cluster_name!r} is invalid: ensure it is fully matched by regex "
            f"(e.g., only contains letters, numbers and dash): {_CLUSTER_NAME.pattern}"
        )
    task = Task.from_yaml_config(task_config)
    task.validate()
    resources = next(iter(task.resources))
    idle, to_down = _autostop_request(resources, idle_minutes_to_autostop, down)
    features = set()
    if any(str(s.get("mode", "MOUNT")).upper() != "COPY" for s in task.storage_mounts.values()):
        features.add(_F.STORAGE_MOUNTING)
    if idle is not None and idle >= 0:
        features.add(_F.AUTODOWN if to_down else _F.AUTOSTOP)
    if resources.cloud is not None:
        resources.cloud.check_features_are_supported(resources, features)
    if dryrun:
        return [None, None]
    record = _provision(state, cluster_name, resources)
    _sync(state, cluster_name, task)
    with _lock(state, cluster_name):
        record = require_record(state, cluster_name, record["id"])
        record.update(status=ClusterStatus.UP.value, launched_at=int(time.time()), cluster_ever_up=True)
        _save(state, record)
    _write_ssh_config(cluster_name)
    _say(f"Cluster {cluster_name!r} is UP.")
    job_id = None
    if task.run is not None or task.setup is not None:
        job_id = _submit(state, record, task, no_setup)
        _say(f"Job submitted, ID: {job_id}")
    if idle is not None:
        # Armed last (SkyPilot: once the launch has gone far enough), after
        # the job, so a short fake minute cannot down the cluster before it.
        set_autostop(state, cluster_name, idle, to_down)
    return [job_id, None]


def exec_task(
    state: Path, task_config: dict[str, Any], cluster_name: str, *, dryrun: bool = False
) -> list[Any]:
    """sky.exec: a job on a cluster that is UP; its setup and file mounts are not run again."""
    task = Task.from_yaml_config(task_config)
    task.validate(skip_file_mounts=True)
    record = require(state, cluster_name, "executing task")
    if dryrun:
        return [None, None]
    if isinstance(task.workdir, str):
        _copy(Path(task.workdir), remote_path(state, cluster_name, "~/sky_workdir"))
    return [_submit(state, record, task, no_setup=True), None]


def require_record(state: Path, name: str, cluster_id: str) -> dict[str, Any]:
    record = load(state, name)
    if record is None or record["id"] != cluster_id:
        raise exceptions.ClusterDoesNotExist(f"Cluster {name!r} was torn down while launching.")
    return record


def _autostop_request(resources: Resources, idle: int | None, down: bool) -> tuple[int | None, bool]:
    """As the SDK does: launch's down/idle override resources.autostop; down
    without idle minutes means "down once idle"; 0 idle minutes become 1
    ("after all jobs finish", so the new job is not raced)."""
    config = resources.autostop_config
    if down or idle is not None:
        config = dict(config or {"idle_minutes": 0, "down": False})
        if down:
            config["down"] = True
        if idle is not None:
            config["idle_minutes"] = idle
    if config is None:
        return None, False
    minutes = int(config["idle_minutes"])
    return (1 if minutes == 0 else minutes), bool(config["down"])


def _provision(state: Path, name: str, resources: Resources) -> dict[str, Any]:
    with _lock(state, name):
        record = load(state, name)
        fresh = record is None or record["status"] != ClusterStatus.UP.value
        if record is None:
            record = {
                "name": name, "id": uuid.uuid4().hex, "status": ClusterStatus.INIT.value,
                "launched_at": None, "cluster_ever_up": False, "autostop": None, "timer": None,
                "cloud": None if resources.cloud is None else repr(resources.cloud).lower(),
                "resources_str": f"1x {resources.cloud or 'local'}({resources.infra or ''})",
                # What was launched: the resources asked for (the fake chooses no instance type)
                "resources": resources.to_yaml_config(),
            }  # fmt: skip
            (cluster_dir(state, name) / "home").mkdir(parents=True, exist_ok=True)
            remember_cluster_id(state, record["id"])
        elif fresh:
            record["status"] = ClusterStatus.INIT.value
        _save(state, record)
    _say(f"Launching a new cluster {name!r}." if fresh else f"Reusing the UP cluster {name!r}.")
    if fresh:
        time.sleep(env_float("FAKESKY_LAUNCH_DELAY", 0.0))
    return record


def _sync(state: Path, name: str, task: Task) -> None:
    if isinstance(task.workdir, str):
        _copy(Path(task.workdir), remote_path(state, name, "~/sky_workdir"))
    for destination, source in (task.file_mounts or {}).items():
        target = remote_path(state, name, destination)
        if is_cloud_url(source):
            _bucket(source, "COPY", target)
        else:
            _copy(Path(source), target)
    for destination, spec in task.storage_mounts.items():
        source = str(spec.get("source") or spec.get("name"))
        _bucket(source, str(spec.get("mode", "MOUNT")).upper(), remote_path(state, name, destination))
    _say("Synced file mounts.")


def _copy(source: Path, target: Path) -> None:
    """As SkyPilot's rsync: a folder's contents into `target`, skipping what
    its .gitignore files (or .skyignore, if it has one) exclude."""
    target.parent.mkdir(parents=True, exist_ok=True)
    rsync = shutil.which("rsync")
    if rsync is None:  # no filters then
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)
        return
    argv = [rsync, "-a", "--no-owner", "--no-group"]
    if source.is_dir():
        ignore = ".skyignore" if (source / ".skyignore").exists() else ".gitignore"
        argv.append(f"--filter=dir-merge,- {ignore}")
        if ignore == ".gitignore" and (source / ".git" / "info" / "exclude").exists():
            argv.append(f"--exclude-from={source / '.git' / 'info' / 'exclude'}")
        # Made here: fake clusters share this machine's disk, and two launches
        # at once would race in rsync's own mkdir of the same folder.
        target.mkdir(parents=True, exist_ok=True)
        argv += [f"{source}/", str(target)]
    else:
        argv += [str(source), str(target)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"rsync {source} -> {target} failed: {done.stderr.strip()}")


def _bucket(source: str, mode: str, target: Path) -> None:
    """A bucket is a folder under FAKESKY_BUCKET_DIR (<dir>/<bucket>/<prefix>):
    MOUNT and MOUNT_CACHED symlink to it, COPY copies it."""
    root = os.environ.get("FAKESKY_BUCKET_DIR")
    if not root or not is_cloud_url(source):
        raise exceptions.NotSupportedError(
            f"fakesky cannot {mode} {source!r} at {target}: only bucket URLs, and only when "
            "FAKESKY_BUCKET_DIR names the folder that holds the buckets"
        )
    folder = Path(root) / source.split("://", 1)[1].strip("/")
    folder.mkdir(parents=True, exist_ok=True)
    if mode == "COPY":
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(folder, target, symlinks=True, dirs_exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink():
        target.unlink()
    elif target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    target.symlink_to(folder, target_is_directory=True)


def ssh_config_path(name: str) -> Path:
    return Path.home() / ".sky" / "generated" / "ssh" / name


def _write_ssh_config(name: str) -> None:
    """What SkyPilot writes for `ssh <cluster>`, pointed at FAKESKY_SSH_*.
    Every session carries the cluster's marker (SetEnv; the host's sshd
    accepts it), so what runs there over ssh is the cluster's as its jobs
    are: gone with it. A cluster taken away (preempt) is written as
    SkyPilot's proxy into a Slurm job that has ended behaves: the
    connection is closed before the key exchange, exit 255."""
    host = os.environ.get("FAKESKY_SSH_HOST")
    if not host:
        return
    record = load(state_dir(), name) or {}
    identity = os.environ.get("FAKESKY_SSH_IDENTITY", "~/.ssh/sky-key")
    reach = "  ProxyCommand false\n" if record.get("preempted") else ""
    marker = f"  SetEnv {MARKER}={record['id']}\n" if record.get("id") else ""
    text = (
        f"# Added by sky (use `sky stop/down {name}` to remove)\n"
        f"Host {name}\n"
        f"  HostName {host}\n"
        f"  User {os.environ.get('FAKESKY_SSH_USER') or getpass.getuser()}\n"
        f"  IdentityFile {identity}\n"
        "  IdentitiesOnly yes\n"
        "  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile=/dev/null\n"
        "  GlobalKnownHostsFile=/dev/null\n"
        f"  Port {os.environ.get('FAKESKY_SSH_PORT', '22')}\n"
        f"{marker}{reach}\n"
    )
    _write_text(ssh_config_path(name), text)


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


# --------------------------------------------------------------------- jobs


def _submit(state: Path, record: dict[str, Any], task: Task, no_setup: bool) -> int:
    name = record["name"]
    workdir = remote_path(state, name, "~/sky_workdir")
    with _lock(state, name):
        job_id = max((int(j["job_id"]) for j in jobs(state, name)), default=0) + 1
        job = {
            "job_id": job_id, "job_name": task.name or "sky-cmd", "username": getpass.getuser(),
            "user_hash": "fakesky", "submitted_at": time.time(), "start_at": None, "end_at": None,
            "resources": record["resources_str"], "status": JobStatus.INIT.value,
            "log_path": str(job_log(state, name, job_id)), "pid": None, "ticks": None,
            "exit_code": None, "setup": None if no_setup else task.setup, "run": task.run,
            "envs": task.envs_and_secrets,
            "cwd": str(workdir if workdir.is_dir() else remote_path(state, name, "~")),
        }  # fmt: skip
        write_json(job_file(state, name, job_id), job, mode=0o600)  # secrets
        job_log(state, name, job_id).touch()
    env = {**os.environ, MARKER: record["id"]}
    pid, ticks = spawn(state, "job", [name, record["id"], str(job_id)], env=env)
    with _lock(state, name):
        job = read_json(job_file(state, name, job_id))
        if job is not None and job["pid"] is None:
            job.update(pid=pid, ticks=ticks)
            write_json(job_file(state, name, job_id), job, mode=0o600)
    return job_id


def _update_job(state: Path, name: str, job_id: int, status: JobStatus, **fields: Any) -> bool:
    """Move a job on, unless it has already ended (cancelled, say)."""
    with _lock(state, name):
        job = read_json(job_file(state, name, job_id))
        if job is None or JobStatus(job["status"]).is_terminal():
            return False
        job.update(status=status.value, **fields)
        write_json(job_file(state, name, job_id), job, mode=0o600)
        return True


def _job_env(record: dict[str, Any], job: dict[str, Any], home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKESKY_")}
    env[MARKER] = record["id"]
    paths = [p for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p and p != str(FAKE_ROOT)]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(job["envs"])
    env.update(
        HOME=str(home), SKYPILOT_NODE_RANK="0", SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_IPS="127.0.0.1",
        SKYPILOT_NUM_GPUS_PER_NODE="0", SKYPILOT_CLUSTER_INFO=record["name"],
        SKYPILOT_TASK_ID=f"sky-{record['name']}-{job['job_id']}",
    )  # fmt: skip
    return env


def run_job(state: Path, name: str, cluster_id: str, job_id: int) -> int:
    """The job's own process (a session leader): setup, then run, each
    `bash -c` in the cluster's home, output appended to the job's log."""
    path = job_file(state, name, job_id)
    with _lock(state, name):
        record, job = load(state, name), read_json(path)
        if not record or record["id"] != cluster_id or not job or JobStatus(job["status"]).is_terminal():
            return 0
        job.update(pid=os.getpid(), ticks=own_ticks())
        write_json(path, job, mode=0o600)
    if env_float("FAKESKY_QUEUE_JOBS", 0.0) and not _wait_turn(state, name, job_id):
        return 0
    env = _job_env(record, job, cluster_dir(state, name) / "home")
    bash = shutil.which("bash") or "sh"
    with job_log(state, name, job_id).open("ab") as log:

        def step(script: str) -> int:
            argv = [bash, "-c", script]
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  env=env, cwd=job["cwd"], check=False)  # fmt: skip
            return done.returncode

        if job.get("setup"):
            if not _update_job(state, name, job_id, JobStatus.SETTING_UP):
                return 0
            code = step(job["setup"])
            if code != 0:
                _update_job(state, name, job_id, JobStatus.FAILED_SETUP, end_at=time.time(), exit_code=code)
                return 0
        if not _update_job(state, name, job_id, JobStatus.RUNNING, start_at=time.time()):
            return 0
        code = step(job["run"]) if job.get("run") else 0
    time.sleep(env_float("FAKESKY_JOB_END_DELAY", 0.0))  # SkyPilot's driver lags the job's end
    gate = os.environ.get("FAKESKY_JOB_END_GATE")
    while gate and not os.path.exists(gate):  # a lag a test ends when it chooses
        time.sleep(0.05)
    final = JobStatus.SUCCEEDED if code == 0 else JobStatus.FAILED
    _update_job(state, name, job_id, final, end_at=time.time(), exit_code=code)
    return 0


def _wait_turn(state: Path, name: str, job_id: int) -> bool:
    """PENDING while an earlier job of the cluster has not ended, as SkyPilot
    queues a job whose resources another job holds (until its driver has
    seen it end: FAKESKY_JOB_END_DELAY). False if it ended meanwhile
    (cancelled from the queue)."""
    while any(int(j["job_id"]) < job_id and not job_status(j).is_terminal() for j in jobs(state, name)):
        if not _update_job(state, name, job_id, JobStatus.PENDING):
            return False
        time.sleep(0.05)
    return True


def job_statuses(state: Path, cluster_name: str, job_ids: list[int] | None) -> list[list[Any]]:
    """[[job_id, status name or None], ...]; the latest job when job_ids is None."""
    require(state, cluster_name, "getting job status")
    known = {int(j["job_id"]): j for j in jobs(state, cluster_name)}
    if job_ids is None:
        latest = max(known, default=None)
        return [[latest, None if latest is None else job_status(known[latest]).value]]
    return [[int(i), job_status(known[int(i)]).value if int(i) in known else None] for i in job_ids]


def queue(state: Path, cluster_name: str, skip_finished: bool = False) -> list[dict[str, Any]]:
    require(state, cluster_name, "getting the job queue")
    records = []
    for job in reversed(jobs(state, cluster_name)):
        status = job_status(job)
        if skip_finished and status.is_terminal():
            continue
        records.append({
            "job_id": job["job_id"], "job_name": job["job_name"], "username": job["username"],
            "user_hash": job["user_hash"], "submitted_at": job["submitted_at"],
            "start_at": job["start_at"], "end_at": job["end_at"], "resources": job["resources"],
            "status": status.value, "log_path": job["log_path"], "metadata": {}, "links": {},
        })  # fmt: skip
    return records


def _mark_cancelled(state: Path, name: str, chosen: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Mark unfinished jobs CANCELLED (lock held by the caller); their processes."""
    targets = []
    for job in chosen:
        if job_status(job).is_terminal():
            continue
        job.update(status=JobStatus.CANCELLED.value, end_at=time.time())
        write_json(job_file(state, name, int(job["job_id"])), job, mode=0o600)
        if job.get("pid"):
            targets.append((int(job["pid"]), int(job["ticks"])))
    return targets


def cancel(state: Path, cluster_name: str, job_ids: list[int] | None = None, all: bool = False) -> None:
    if all and job_ids is not None:
        raise exceptions.NotSupportedError("Cannot specify both --all and job IDs.")
    require(state, cluster_name, "cancelling jobs")
    with _lock(state, cluster_name):
        found = jobs(state, cluster_name)
        if all:
            chosen = found
        elif job_ids is not None:
            wanted = {int(i) for i in job_ids}
            chosen = [j for j in found if int(j["job_id"]) in wanted]
        else:
            chosen = found[-1:]
        targets = _mark_cancelled(state, cluster_name, chosen)
    for pid, ticks in targets:
        stop_group(pid, ticks, grace=env_float("FAKESKY_CANCEL_GRACE", 3.0))


# ----------------------------------------------------------- down, autostop


def teardown(state: Path, cluster_name: str, terminate: bool = True) -> None:
    """down (terminate) or stop: every job and process of the cluster goes,
    abruptly, as with its VM; down also removes its folder and ssh config."""
    with _lock(state, cluster_name):
        record = load(state, cluster_name)
        if record is None:
            raise exceptions.ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        targets = _mark_cancelled(state, cluster_name, jobs(state, cluster_name))
    timer = record.get("timer") or {}
    if timer.get("pid") and timer["pid"] != os.getpid():
        targets.append((timer["pid"], timer["ticks"]))
    for pid, ticks in targets:
        stop_group(pid, ticks, grace=0)
    kill_marked(record["id"])
    with _lock(state, cluster_name):
        if terminate:
            shutil.rmtree(cluster_dir(state, cluster_name), ignore_errors=True)
            ssh_config_path(cluster_name).unlink(missing_ok=True)
            return
        record = load(state, cluster_name) or record
        record.update(status=ClusterStatus.STOPPED.value, autostop=None, timer=None)
        _save(state, record)


def set_autostop(state: Path, cluster_name: str, idle_minutes: int, down: bool = False) -> None:
    record = require(state, cluster_name, "setting autostop")
    cloud = clouds.from_name(record["cloud"]) if record.get("cloud") else None
    if cloud is not None and idle_minutes >= 0:
        cloud.check_features_are_supported(None, {_F.AUTODOWN if down else _F.AUTOSTOP})
    with _lock(state, cluster_name):
        record = load(state, cluster_name) or record
        if idle_minutes < 0:
            record["autostop"] = None
        else:
            record["autostop"] = {"idle_minutes": idle_minutes, "down": down, "set_at": time.time()}
            timer = record.get("timer") or {}
            if not alive(timer.get("pid"), timer.get("ticks")):
                pid, ticks = spawn(state, "timer", [cluster_name, record["id"]])
                record["timer"] = {"pid": pid, "ticks": ticks}
        _save(state, record)
    _say(f"Autostop for {cluster_name!r}: {idle_minutes} idle minutes, {'down' if down else 'stop'}.")


def _idle_action(state: Path, name: str, cluster_id: str, minute: float) -> str | None:
    """'down' / 'stop' when the cluster has been idle long enough; 'quit'
    when this timer is no longer wanted; None to keep waiting."""
    with _lock(state, name):
        record = load(state, name)
        autostop = (record or {}).get("autostop")
        if (not record or record["id"] != cluster_id or autostop is None
                or (record.get("timer") or {}).get("pid") != os.getpid()):  # fmt: skip
            return "quit"
        if record["status"] != ClusterStatus.UP.value:
            return None
        found = jobs(state, name)
        if any(not job_status(j).is_terminal() for j in found):
            return None
        last_active = max([autostop["set_at"], record.get("launched_at") or 0]
                          + [j.get("end_at") or 0 for j in found])  # fmt: skip
        if time.time() - last_active < autostop["idle_minutes"] * minute:
            return None
        record["status"] = ClusterStatus.AUTOSTOPPING.value
        _save(state, record)
        return "down" if autostop["down"] else "stop"


def timer_loop(state: Path, name: str, cluster_id: str) -> int:
    """The autostop timer (skylet's job): checks a few times a minute."""
    minute = env_float("FAKESKY_MINUTE_SECONDS", 60.0)
    while True:
        time.sleep(max(0.05, minute / 4))
        action = _idle_action(state, name, cluster_id, minute)
        if action == "quit":
            return 0
        if action is not None:
            with contextlib.suppress(exceptions.ClusterDoesNotExist):
                teardown(state, name, terminate=action == "down")
            return 0


def preempt(state: Path, cluster_name: str) -> None:
    """The cluster taken away behind SkyPilot's back, as a spot preemption
    or a Slurm allocation cancelled (scancel) is: every process of it dies
    at once (its jobs, its timer, what runs there over ssh, and the ssh
    connections into it), ssh to it fails, and its record still reads UP
    until a status refresh asks the cloud, which removes it (measured on
    the Slurm bed with SkyPilot 0.14.1: see backends/skypilot/backend.py)."""
    with _lock(state, cluster_name):
        record = load(state, cluster_name)
        if record is None:
            raise exceptions.ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        record["preempted"] = True
        _save(state, record)
        targets = [(j["pid"], j.get("ticks")) for j in jobs(state, cluster_name) if j.get("pid")]
    timer = record.get("timer") or {}
    if timer.get("pid"):
        targets.append((timer["pid"], timer["ticks"]))
    # The network first, as a machine going away: no new connection reaches
    # it, and those open are dropped before its processes go (so no client
    # reads its dead worker's record over one).
    _write_ssh_config(cluster_name)
    for connection, started in sessions_serving(record["id"]):
        if alive(connection, started):
            with contextlib.suppress(ProcessLookupError):
                os.kill(connection, signal.SIGKILL)
    for pid, ticks in targets:
        stop_group(pid, ticks, grace=0)
    kill_marked(record["id"])


def _refreshed(state: Path, name: str) -> dict[str, Any] | None:
    """The record as a refresh leaves it: a cluster the cloud no longer
    holds is removed (with its ssh config), as SkyPilot removes one whose
    autodown was set."""
    with _lock(state, name):
        record = load(state, name)
        if record is None or not record.get("preempted"):
            return record
        shutil.rmtree(cluster_dir(state, name), ignore_errors=True)
        ssh_config_path(name).unlink(missing_ok=True)
        return None


def cluster_records(
    state: Path, cluster_names: list[str] | None, refresh: str = "NONE"
) -> list[dict[str, Any]]:
    names = cluster_names
    if names is None:
        names = sorted(p.name for p in (state / "clusters").glob("*") if (p / "cluster.json").exists())
    records = []
    for name in names:
        record = load(state, name) if refresh == "NONE" else _refreshed(state, name)
        if record is None:
            continue
        autostop = record.get("autostop") or {}
        records.append({
            "name": name, "launched_at": int(record.get("launched_at") or 0),
            "handle": launched_handle(record),
            "last_use": "sky launch", "status": record["status"],
            "autostop": int(autostop.get("idle_minutes", -1)), "to_down": bool(autostop.get("down")),
            "owner": None, "metadata": {}, "cluster_hash": record["id"],
            "cluster_ever_up": bool(record.get("cluster_ever_up")),
            "status_updated_at": record.get("status_updated_at"), "user_hash": "fakesky",
            "user_name": getpass.getuser(), "workspace": "default", "is_managed": False,
            "resources_str": record.get("resources_str"),
        })  # fmt: skip
    return records


def launched_handle(record: dict[str, Any]) -> dict[str, Any] | None:
    """The cluster's handle as the client decodes it (_client._decode):
    what was launched, on how many nodes; none before the launch."""
    if record.get("resources") is None or not record.get("cluster_ever_up"):
        return None
    return {"launched_resources": record["resources"], "launched_nodes": 1}
