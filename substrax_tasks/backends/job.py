"""The job file `remote/worker.py` reads, and how its status file reads back.

Shared by every backend that runs the worker (local, ssh, skypilot): they
differ only in where the folders are and how the files travel. Both files
are defined once, in remote/runfiles.py, which the worker imports too.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from substrax_tasks._remote import runfiles
from substrax_tasks.console import emit
from substrax_tasks.errors import HandleError
from substrax_tasks.step.spec import StepSpec

if TYPE_CHECKING:
    from substrax_tasks.backends.base import RunStatus
    from substrax_tasks.store.cost import CapDeadline

STATUS_FILE = "status.json"
# An attempt is started only with some of the timeout left (the core does
# not relaunch a run whose timeout is spent); this floor keeps a job's
# timeout positive whatever the clocks said.
MIN_TIMEOUT_LEFT = 1.0


@dataclass(frozen=True)
class WorkerPaths:
    """Where one run's files live on the machine that runs it."""

    project: str
    run_dir: str

    @property
    def job(self) -> str:
        return f"{self.run_dir}/job.json"

    @property
    def status(self) -> str:
        return f"{self.run_dir}/{STATUS_FILE}"

    @property
    def log(self) -> str:
        return f"{self.run_dir}/run.log"

    @property
    def staging(self) -> str:  # what the sandboxed task writes
        return f"{self.run_dir}/work/outputs"

    @property
    def home(self) -> str:  # the sandbox's home for one run; the worker removes it as the run ends
        return f"{self.run_dir}/work/home"


def project_key(project: str) -> str:
    """A folder name for one client's project on a shared machine: its name
    to read, a digest of its path to tell two projects of that name apart."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", PurePosixPath(project).name).strip("-.")[:40] or "project"
    return f"{name}-{hashlib.sha256(project.encode()).hexdigest()[:12]}"


def build_job(
    spec: StepSpec,
    paths: WorkerPaths,
    *,
    sandbox: str,
    network_isolation: bool,
    grace_seconds: float,
    hide: list[str],
    extra_ro: list[str] | None = None,
    env_dir: str | None = None,
    cache_dirs: Sequence[str] = (),
    cache_root: str | None = None,
    project_hidden: Sequence[str] = (),
    project_shown: Sequence[str] | None = None,
    left_out: Sequence[str] = (),
    gpus: runfiles.JobGpus | None = None,
    checkpoints_kept: str | None = None,
    timeout_spent: float = 0.0,
    cap: CapDeadline | None = None,
) -> runfiles.Job:
    """The job; `env_dir`: the environment built from the project's lock
    file, first on the task's PATH and readable in the sandbox;
    `project_hidden`: project paths the sandbox hides (a local run sees
    what a remote one gets, see project_view.py), `project_shown`: the
    paths it shows (an entry made after the view was taken is in neither,
    and stays hidden), `left_out`: those a failure names when its log
    mentions them;
    `cache_dirs` (validated "~/..." folders of the sandbox's home) are kept
    across runs under `cache_root`, at the same paths below it; `gpus`:
    what the worker takes and shows the task (_gpus.job_gpus);
    `checkpoints_kept`: the folder kept for the step's checkpoints on that
    machine, shown to the task at the spec's `checkpoints` path;
    `timeout_spent`: how long the command ran in the run's earlier attempts
    (`CoreState.command_seconds_spent()`): the spec's timeout bounds them
    all, so this attempt's worker gets what is left;
    `cap`: when the run's cost reaches its max_cost (store/cost.py): the
    worker's timeout ends the command then, with the cap as its reason, so
    the cap holds with no client following the run."""
    timeout = None if spec.timeout is None else max(spec.timeout - timeout_spent, MIN_TIMEOUT_LEFT)
    stop_message = None
    if cap is not None:
        left = max(MIN_TIMEOUT_LEFT, cap.at - time.time())  # the worker starts and is stopped
        if timeout is None or left < timeout:
            timeout, stop_message = left, cap.message
    job: runfiles.Job = {
        "version": runfiles.JOB_VERSION,
        "argv": list(spec.command),
        "cwd": paths.project,
        "project": paths.project,
        "outputs": [runfiles.Output(path=o["path"], kind=o["kind"]) for o in spec.output_entries()],
        "staging": paths.staging,
        "status_file": paths.status,
        "log_file": paths.log,
        "timeout": timeout,
        "grace_seconds": grace_seconds,
        "sandbox": sandbox,
        "network_isolation": network_isolation,
        "hide": hide,
        "extra_ro": list(extra_ro or []),
        "env": dict(spec.env),
        # names only: the values come from the worker's environment (local)
        # or its stdin (remote), never from a file
        "forward_env": list(spec.forward_env),
        "home_dir": paths.home,
        "cache_dirs": [],
        "project_hidden": list(project_hidden),
        "left_out": list(left_out),
    }
    if stop_message is not None:
        job["timeout_message"] = stop_message
    if project_shown is not None:
        job["project_shown"] = list(project_shown)
    if gpus is not None:
        job["gpus"] = gpus
    if spec.checkpoints is not None:
        if checkpoints_kept is None:
            raise ValueError("a step with checkpoints needs the folder they are kept in")
        job["checkpoints"] = runfiles.Checkpoints(path=spec.checkpoints.rstrip("/"), kept=checkpoints_kept)
    for folder in cache_dirs:
        if cache_root is None:
            raise ValueError("cache_dirs need a cache_root")
        rel = folder[2:].rstrip("/")  # validated: "~/" and a clean relative path
        job["cache_dirs"].append({"path": rel, "kept": f"{cache_root}/{rel}"})
    if env_dir is not None:
        job["extra_ro"].append(env_dir)
        job["path_prepend"] = [f"{env_dir}/bin"]
        job["env"]["VIRTUAL_ENV"] = env_dir
    return job


def env_dir_of(step: str, answer: dict[str, Any]) -> str | None:
    """The environment's folder from remote/env.py's answer ({}: no lock
    file), with what was done said to the user."""
    if not answer:
        return None
    verb = "reusing the environment for" if answer["reused"] else "built the environment from"
    emit(f"{step}: {verb} {answer['lock']} ({answer['digest']})")
    return str(answer["env_dir"])


def damaged_status(record: runfiles.StatusAnswer, host: str | None = None) -> RunStatus:
    """A run whose status file is damaged (control.py's `status` said so):
    lost when no worker of it is going, so its step is launched again;
    while one is, a HandleError naming it, since the run's state cannot be
    known and a second run must not start beside it."""
    from substrax_tasks.backends.base import RunStatus

    damage = record.get("damaged")
    pids = record.get("worker_pids") or []
    if not pids:
        return RunStatus("lost", message=f"its status file {damage}, and no worker of it is going")
    on = f" on {host}" if host else ""
    raise HandleError(
        f"its status file {damage}, and its worker (pid {', '.join(map(str, pids))}{on}) is still going: "
        f"its state cannot be known. Stop that worker (kill {' '.join(map(str, pids))}{on}) and run "
        "again: the run then reads as lost, and its step is launched again"
    )


def status_from_record(record: runfiles.StatusAnswer | None, worker_alive: bool) -> RunStatus:
    """Read the worker's status file. A `running` record whose worker is
    gone means the worker was killed before it could say how things ended;
    its `ended_at`, if any, is when the run's guard saw its command end
    with it (remote/guard.py): its machine time ends there."""
    from substrax_tasks.backends.base import RunStatus  # pydantic: kept off a no-op doit's path

    if record is None:
        return RunStatus("pending")
    state = str(record.get("state", "pending"))
    if state in ("running", "starting") and not worker_alive:
        return RunStatus(
            "lost",
            started_at=record.get("started_at"),
            ended_at=record.get("ended_at"),
            message="the worker stopped without recording an end (killed, or the machine restarted)",
        )
    if state == "starting":  # its worker is alive and will start it: never a second one
        state = "running"
    return RunStatus(
        state,
        exit_code=record.get("exit_code"),
        started_at=record.get("started_at"),
        ended_at=record.get("ended_at"),
        message=record.get("message"),
        gpus=record.get("gpus"),
    )
