"""The SkyPilot task a run becomes: resources, file mounts, setup and run.

Pure functions of the handle and the settings, so the generated config can
be written to disk as the run's intent before anything is launched, and
validated by the real SkyPilot in tests for every shape. Three are not:
`validate` (SkyPilot reads the task), and `job_home` and `at_job_home`,
where those paths are once the job runs.

The task is the cluster's, not a step's: its setup arms the cluster's
lifetime timer, runs setup_commands and builds the locked environment; its
run is the lease (remote/lease.py), which holds the cluster while steps run
through the worker over ssh. On the cluster, relative to the home the job
runs in (`remote_root`):

    bin-<digest>/            the remote/ scripts (COPY mount)
    leases/<cluster>/        the lease's record and lock; the lifetime timer removes it
    runs/<run-id>/project/   the first step's snapshot and sources (COPY mounts, then rsync)
    runs/<run-id>/work/outputs/  what the task writes (copy transport)
    runs/<run-id>/work/checkpoints/  the step's checkpoints, shown to it at its `checkpoints` path
    mnt/<bucket-key>/<run-id>/   outputs and manifest.json (bucket transport)
    mnt/<bucket-key>/checkpoints/<client id>/<step>/<key>/  its snapshots (bucket transport)
    envs/<digest>/           the environment built from the lock file
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shlex
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from substrax_tasks._remote import env, runfiles
from substrax_tasks.backends.job import WorkerPaths, build_job, project_key
from substrax_tasks.backends.remote_run import checked_script, scripts_digest
from substrax_tasks.backends.skypilot.client import SkyCallError, SkyClient
from substrax_tasks.backends.skypilot.settings import (
    AUTODOWN_MINUTES,
    NO_AUTODOWN,
    SkypilotSettings,
    cloud_of,
)
from substrax_tasks.backends.skypilot.state import SkypilotState
from substrax_tasks.errors import SubstraxError
from substrax_tasks.hardlinks import link_tree
from substrax_tasks.step.spec import safe_name
from substrax_tasks.step.view import project_view, written_paths
from substrax_tasks.store.cost import cap_deadline
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.run_store import RunStore


class SkyConfigRefused(SubstraxError):
    """SkyPilot refused the generated task: a configuration error, not retried."""


# The job prints its home to its log (the setup's first line): a shell that
# ssh starts may be elsewhere (see at_job_home). Read there only for a
# cluster whose lease did not write it where ssh lands (IN_JOB_HOME).
HOME_MARK = re.compile(r"substrax-job-home:(/.*?):end")
# `python3 -c IN_JOB_HOME FILE ARGV...`: Python 3.8, stdlib. Run ARGV in
# the home the cluster's lease job runs in, as its setup wrote it to FILE
# (relative to the login's home, where ssh lands: remote/lease.py); exit
# NO_JOB_HOME while there is none (the setup has not begun). A path is read
# as far as PATH_MAX at most: whatever else is in the file is not a home.
NO_JOB_HOME = 4
# How much of the lease job's log is read for HOME_MARK (its setup's first line).
JOB_LOG_HEAD_BYTES = 64 << 10
IN_JOB_HOME = """\
import os, pwd, sys
try:
    with open(os.path.join(pwd.getpwuid(os.getuid()).pw_dir, sys.argv[1])) as f:
        os.chdir(f.read(4096).strip())
except OSError:
    sys.exit(EXIT)
os.execvp(sys.argv[2], sys.argv[2:])
""".replace("EXIT", str(NO_JOB_HOME))
_UNSAFE = re.compile(r"[^a-z0-9]+")
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9]+")


CLIENT_TAG_LENGTH = 8
# In the outputs bucket, beside the runs' folders: the steps' snapshots.
CHECKPOINTS_IN_BUCKET = "checkpoints"


def checkpoints_of(client_id: str) -> str:
    """The folder of one client's snapshots in the outputs bucket, relative
    to it. Many clients share a bucket (clones, branches, CI jobs), and
    each may have a step of the same name: each lists, restores and removes
    only the snapshots under its own id (store.client_id), never another's."""
    return f"{CHECKPOINTS_IN_BUCKET}/{client_id}"


def client_tag(client_id: str) -> str:
    """What of the client's id (store.client_id) a cluster's name carries."""
    return client_id[:CLIENT_TAG_LENGTH]


def cluster_name(settings: SkypilotSettings, handle: RunHandle, client_id: str) -> str:
    """`<prefix>-<step>-<client tag>-<6 hex>`: SkyPilot's rules (a letter
    first; letters, digits and '-'), short enough for every cloud, unique per
    run, and marked as this client's by 32 random bits of its id (gc --machines
    takes down only clusters that carry it, or that its handles name)."""
    slug = _UNSAFE.sub("-", handle.step.lower()).strip("-")[:10].strip("-") or "step"
    # A relaunch's cluster is named apart from the lost one's: SkyPilot may
    # still hold a record of that one as UP, and would reuse it by its name.
    suffix = hashlib.sha256(run_folder(handle).encode()).hexdigest()[:6]
    return f"{settings.cluster_prefix}-{slug}-{client_tag(client_id)}-{suffix}"


def run_folder(handle: RunHandle) -> str:
    """The run's folder under `runs/` on its cluster: its id, and for a
    relaunch (`preemptions`) the attempt's number too. Clusters of a
    Slurm site or a shared `remote_root` share a file system, where the
    lost attempt's folder may still be."""
    attempts = len(handle.state.attempts)
    return handle.run_id if attempts <= 1 else f"{handle.run_id}-attempt{attempts}"


def made_by(cluster: str, prefix: str, client_id: str) -> bool:
    """Whether `cluster` is named as this client's (cluster_name)."""
    parts = cluster.rsplit("-", 2)
    return cluster.startswith(f"{prefix}-") and len(parts) == 3 and parts[1] == client_tag(client_id)


@dataclass(frozen=True)
class ClusterLayout:
    """Where a run's files are on the cluster, relative to the home folder
    (or absolute, when remote_root is)."""

    root: str
    folder: str  # the run's folder's name (run_folder): its id, or its id and attempt
    bin_digest: str
    bucket_key: str | None = None

    @property
    def bin(self) -> str:
        return f"{self.root}/bin-{self.bin_digest}"

    @property
    def run(self) -> str:
        return f"{self.root}/runs/{self.folder}"

    def lease(self, cluster: str) -> str:
        return f"{self.root}/leases/{cluster}"

    def job_home_file(self, cluster: str) -> str:
        """Where the lease of a relative root writes its job's home, relative to the login's home."""
        return f"{self.root}/job-homes/{cluster}"

    @property
    def project(self) -> str:
        return f"{self.run}/project"

    @property
    def checkpoints_kept(self) -> str:
        """Where the step's checkpoints are kept for its command (its `checkpoints` path there)."""
        return f"{self.run}/work/checkpoints"

    def checkpoints_in_bucket(self, client_id: str, step: str, key: str) -> str:
        """Where a step's snapshots go with the bucket transport: in the
        outputs bucket, beside the runs' folders, by client (checkpoints_of),
        step and key."""
        return f"{self.bucket_dir}/{checkpoints_of(client_id)}/{safe_name(step)}/{key}"

    @property
    def bucket_dir(self) -> str:
        assert self.bucket_key is not None
        return f"{self.root}/mnt/{self.bucket_key}"

    @property
    def staging(self) -> str:
        if self.bucket_key is not None:
            return f"{self.bucket_dir}/{self.folder}/outputs"
        return WorkerPaths(project=self.project, run_dir=self.run).staging

    def env_dir(self, digest: str) -> str:
        return f"{self.root}/envs/{digest}"

    @staticmethod
    def mount_point(path: str) -> str:
        """A file mount's destination: SkyPilot expands `~/`."""
        return path if path.startswith("/") else f"~/{path}"


def layout_for(settings: SkypilotSettings, handle: RunHandle) -> ClusterLayout:
    """The run's layout; the scripts are those its launch uploaded (their
    folder is named after their digest), even if this installation's differ
    by now (an upgrade between launch and fetch)."""
    bucket_key = None
    if settings.bucket is not None:
        bucket_key = hashlib.sha256(settings.bucket.outputs_bucket.encode()).hexdigest()[:10]
    pinned = SkypilotState.of(handle).bin_digest
    digest = pinned if isinstance(pinned, str) else scripts_digest()
    return ClusterLayout(settings.remote_root.rstrip("/"), run_folder(handle), digest, bucket_key)


def environment(
    settings: SkypilotSettings, layout: ClusterLayout, project: Path
) -> tuple[str | None, str | None]:
    """The lock file the environment is built from, and its folder (None, None: no lock)."""
    lock = env.lock_file(str(project))
    if lock is None:
        return None, None
    return lock, layout.env_dir(env.digest(str(project), lock, settings.python, settings.pip_args))


def worker_job(
    settings: SkypilotSettings,
    handle: RunHandle,
    layout: ClusterLayout,
    env_dir: str | None,
    left_out: list[str] | None = None,
    *,
    gpus: runfiles.JobGpus | None = None,
) -> runfiles.Job:
    """The worker's job, its folders relative to the home folder (the worker
    resolves them where it starts: the home is unknown until launch); the
    step's checkpoints, if any, kept in the run's folder (`checkpoints_kept`)."""
    job = build_job(
        handle.spec,
        WorkerPaths(project=layout.project, run_dir=layout.run),
        sandbox=settings.sandbox,
        network_isolation=settings.transport.network_isolation,
        grace_seconds=settings.grace_seconds,
        # The home folder (its credentials are not the task's) and the
        # remote root (an absolute one is outside it), where the runs of
        # other steps and clients sit beside this one: its own parts are bound back.
        hide=[".", layout.root],
        env_dir=env_dir,
        cache_dirs=settings.cache_dirs,
        cache_root=f"{layout.root}/cache/{project_key(str(handle.state.project))}",
        left_out=left_out or [],
        gpus=gpus,
        checkpoints_kept=layout.checkpoints_kept,
        timeout_spent=handle.state.command_seconds_spent(),  # a relaunch gets what is left
        cap=cap_deadline(handle),
    )
    job["staging"] = layout.staging
    if layout.bucket_key is not None:  # the bucket transport fetches it with the outputs
        job["manifest_copy"] = f"{layout.bucket_dir}/{layout.folder}/manifest.json"
    return job


def _sh(argv: list[str]) -> str:
    return shlex.join(argv)


def lifetime_timer(settings: SkypilotSettings) -> dict[str, float]:
    """The cluster's lifetime timer as the handle records it (as the ssh
    backend's): armed now, ending in `seconds`. It ends the lease (and every
    run's own timer, armed with what is left, stops its run)
    AUTODOWN_MINUTES before the lifetime ends, so that SkyPilot's autodown
    has the cluster gone by then."""
    seconds = (settings.transport.lifetime_minutes - AUTODOWN_MINUTES) * 60  # > 0: checked
    return {"armed_at": time.time(), "seconds": seconds}


def setup_script(settings: SkypilotSettings, layout: ClusterLayout, cluster: str,
                 lock: str | None, env_dir: str | None) -> str:  # fmt: skip
    """Lifetime timer first (nothing outlives lifetime_minutes even if setup
    hangs), then the setup commands, then the locked environment."""
    seconds = lifetime_timer(settings)["seconds"]
    # Where the job runs, said where ssh lands (lease.py home) for the step's
    # first ssh call, and printed to the job's log (read there only if that failed).
    home = checked_script(settings.python, layout.bin, "lease.py", "home", layout.root, cluster)
    lines = ["set -e", 'cd "$HOME"', "printf 'substrax-job-home:%s:end\\n' \"$(pwd -P)\"",
             watchdog_line(settings, layout, layout.lease(cluster), seconds), _sh(home)]  # fmt: skip
    lines += settings.setup_commands
    if lock and env_dir:
        # The same recipe as every backend's (it prints where the env is: known here already).
        build = checked_script(settings.python, layout.bin, "env.py", layout.project, f"{layout.root}/envs",
                               settings.python, *settings.pip_args)  # fmt: skip
        lines.append(f"{_sh(build)} >/dev/null")
    return "\n".join(lines) + "\n"


def watchdog_line(settings: SkypilotSettings, layout: ClusterLayout, folder: str, seconds: float) -> str:
    """Make `folder` and arm the lifetime timer that removes it `seconds` from now."""
    watchdog = checked_script(settings.python, layout.bin, "control.py", "watchdog", folder, f"{seconds:g}")
    if cloud_of(settings.infra) in NO_AUTODOWN:
        watchdog.append("--poweroff")
    return f'cd "$HOME" && {_sh(["mkdir", "-p", folder])} && {_sh(watchdog)}'


def at_job_home(
    layout: ClusterLayout, sky: SkyClient, store: RunStore, handle: RunHandle, cluster: str
) -> ClusterLayout:
    """The layout at the home the job runs in (job_home); as it is until
    the setup has printed it."""
    home = job_home(sky, store, handle, cluster)
    return replace(layout, root=f"{home}/{layout.root}") if home is not None else layout


def job_home(sky: SkyClient, store: RunStore, handle: RunHandle, cluster: str) -> str | None:
    """The home the cluster's lease job runs in, as its setup printed it to
    the job's log (asked once, then kept in the handle). A shell ssh starts may be
    elsewhere: on Slurm, SkyPilot's ~/.sky_ssh_rc moves it into the
    cluster's folder only when the sshd accepts SKY_CLUSTER_NAME and the
    login's ~/.bashrc gets as far as that line, which a stock one does not
    for a command."""
    with contextlib.suppress(SubstraxError):
        handle = store.read(handle.run_id)  # a caller's copy may predate it
    home, job_id = SkypilotState.of(handle).job_home, SkypilotState.of(handle).launched_job
    if isinstance(home, str) or not isinstance(job_id, int) or SkypilotState.of(handle).torn_down:
        return home if isinstance(home, str) else None
    log = store.run_dir(handle.run_id) / "job-home.log"
    log.unlink(missing_ok=True)  # the helper appends
    try:
        sky.call("tail_logs", {"cluster_name": cluster, "job_id": job_id, "follow": False,
                               "output_file": str(log)})  # fmt: skip
        with log.open("rb") as f:  # the mark is the setup's first line: a log of any size is read so far only
            head = f.read(JOB_LOG_HEAD_BYTES).decode(errors="replace")
        found: list[str] = HOME_MARK.findall(head)
    except (SubstraxError, OSError):
        found = []
    finally:
        log.unlink(missing_ok=True)
    if not found:
        return None
    store.update_backend_state(handle, SkypilotState, job_home=found[-1])
    return found[-1]


def in_job_home(python: str, layout: ClusterLayout, cluster: str, argv: list[str]) -> list[str]:
    """argv run in the home the cluster's lease job runs in (IN_JOB_HOME),
    its relative paths resolved there: the first call to a new cluster
    learns the home in the same ssh session that claims it."""
    return [python, "-c", IN_JOB_HOME, layout.job_home_file(cluster), *argv]


def lease_script(settings: SkypilotSettings, layout: ClusterLayout, cluster: str) -> str:
    """The lease in the foreground (remote/lease.py): the cluster's one
    SkyPilot job, holding it until idle_minutes after its last step."""
    lease = checked_script(settings.python, layout.bin, "lease.py", "hold", layout.root, cluster,
                           f"{settings.idle_minutes * 60:g}")  # fmt: skip
    return f'cd "$HOME" && {_sh(lease)}\n'


def task_config(
    settings: SkypilotSettings,
    handle: RunHandle,
    layout: ClusterLayout,
    *,
    cluster: str,
    upload_dir: Path,
    remote_dir: Path,
    project: Path,
    lock: str | None,
    env_dir: str | None,
) -> dict[str, Any]:
    """The SkyPilot task config (YAML schema, as a dict) of `cluster`, the
    first step's snapshot in it. Secrets are not in it: a step's go to its
    worker on its stdin."""
    mount = ClusterLayout.mount_point
    file_mounts: dict[str, Any] = {
        mount(layout.bin): str(remote_dir),
        mount(layout.project): str(upload_dir / "project"),
    }
    if settings.copy_ is not None:
        for source in settings.copy_.source_paths():
            file_mounts[mount(f"{layout.project}/{source}")] = str(project / source)
    if settings.bucket is not None:
        file_mounts[mount(layout.bucket_dir)] = {"source": settings.bucket.outputs_bucket, "mode": "MOUNT"}
        for path, uri in settings.bucket.buckets.items():
            file_mounts[mount(f"{layout.project}/{path.strip('/')}")] = {"source": uri, "mode": "MOUNT"}
    config: dict[str, Any] = {
        # SkyPilot's task names: letters and digits, single '-' between them
        "name": _UNSAFE_NAME.sub("-", f"substrax-{handle.run_id}")[:60].strip("-"),
        "num_nodes": 1,
        "resources": launched_resources(settings, handle),
        "file_mounts": file_mounts,
        "setup": setup_script(settings, layout, cluster, lock, env_dir),
        "run": lease_script(settings, layout, cluster),
    }
    return config


def launched_resources(settings: SkypilotSettings, handle: RunHandle) -> dict[str, Any]:
    """The resources the run's cluster is launched with: the settings' and
    the step's, on demand for the attempt that asked for it (a relaunch
    with on_demand_last_attempt, SkypilotState.on_demand)."""
    resources = settings.resources(dict(handle.spec.resources))
    if SkypilotState.of(handle).on_demand:
        resources["use_spot"] = False
    return resources


def snapshot(
    settings: SkypilotSettings, handle: RunHandle, project: Path, state_dir: Path, dest: Path
) -> list[str]:
    """The step's view of the project (its inputs and the lock file), as hard
    links (copies across file systems) in `dest`: SkyPilot uploads it.
    Returns what was left out (for a failure to name)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    outputs = {o.rstrip("/") for o in handle.spec.outputs}
    sources = set(settings.copy_.source_paths()) if settings.copy_ is not None else set()
    buckets = {p.strip("/") for p in settings.bucket.buckets} if settings.bucket is not None else set()
    skipped = outputs | sources | buckets
    view = project_view(project, state_dir, handle.spec.inputs, written_paths(handle.spec))
    files = [f for f in view.files if f not in skipped]
    for rel in files:  # an input inside a folder already taken stays as taken
        link_tree(project / rel.rstrip("/"), dest / rel.rstrip("/"))
    # SkyPilot filters a mount through the .gitignore files in it, unless
    # its root holds a .skyignore: an empty one, so that what was chosen
    # above (the declared inputs and the lock file) is what arrives. Written
    # beside and renamed: the snapshot's files are links to the project's.
    ignore = dest / ".skyignore"
    partial = dest / ".skyignore.partial"
    partial.write_text("# substrax-tasks: this snapshot is exactly what is uploaded\n")
    partial.replace(ignore)
    return view.left_out


# The helper's launch: SkyPilot refused the task (its `validate` request) before launching anything.
TASK_REFUSED = "TaskRefused"


def validation(settings: SkypilotSettings) -> dict[str, Any]:
    """How SkyPilot checks the task before launch (the helper's validate)."""
    # check_file_mounts: the snapshot and sources exist by now
    return {"needs_storage_mounting": settings.bucket is not None, "check_file_mounts": True}


def validate(sky: SkyClient, settings: SkypilotSettings, config: dict[str, Any]) -> None:
    """SkyPilot reads the task as it would launch it, or SkyConfigRefused."""
    try:
        sky.call("validate", {"task": config, **validation(settings)})
    except SkyCallError as exc:
        raise refused(settings, exc.kind, exc.detail) from None


def refused(settings: SkypilotSettings, kind: str, detail: str) -> SkyConfigRefused:
    """SkyPilot's refusal of the task (`kind`: its exception's class), and what to check."""
    if kind == TASK_REFUSED:  # the launch's check: the class is the message's first word
        kind, _, detail = detail.partition(": ")
    hint = ""
    if kind == "NotSupportedError" and settings.bucket is not None:
        hint = ("; this provider cannot mount buckets: use the copy transport "
                "([tool.substrax.compute.backends.skypilot.copy])")  # fmt: skip
    return SkyConfigRefused(
        f"SkyPilot refused the task for this step ({kind}: {detail}){hint}; "
        "check [tool.substrax.compute.backends.skypilot] and the step's resources"
    )
