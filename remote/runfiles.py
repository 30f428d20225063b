"""The two files between the client and a run's worker, defined once.

* `job.json`: what the client asks for (substrax_tasks/backends/job.py
  builds it), read by worker.py and by what it calls (sandbox.py, hints.py).
* `status.json`: what the worker says of the run (written by worker.py,
  read and checked by control.py), read back by the client.

Both sides import this very file: the worker and control.py beside it on a
host (by plain name), the client as `substrax_tasks._remote.runfiles`.
Stdlib only, Python 3.8+, imports no sibling.

Each file carries its version. A worker refuses a job of another version
(job_refusal): the client and the worker of a bin folder come from the
same release, so another version means the two were mixed by hand.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, TypedDict

JOB_VERSION = 1
STATUS_VERSION = 1


class Output(TypedDict):
    path: str  # relative to the staging folder, without a trailing "/"
    kind: str  # "file" or "dir"


class CacheDir(TypedDict):
    path: str  # relative to the sandbox's home
    kept: str  # where it is kept across runs


class Checkpoints(TypedDict):
    """The step's checkpoints folder: where the command sees it (`path`,
    relative to the project) and the folder kept for it across attempts."""

    path: str  # without a trailing "/"
    kept: str


class JobGpus(TypedDict):
    """The GPUs a run takes (substrax_tasks/backends/gpus.py job_gpus): a
    count of 0 hides every GPU from the task."""

    count: int
    kind: Optional[str]  # "nvidia", "amd" or None
    ids: List[str]  # the host's GPUs, as its tools name them
    lock_dir: str  # one lock file per GPU, shared by every run of the host


class _JobRequired(TypedDict):
    version: int
    argv: List[str]
    cwd: str
    project: str
    outputs: List[Output]
    staging: str  # what the sandboxed task writes
    status_file: str
    log_file: str
    timeout: Optional[float]  # seconds, None for no limit
    grace_seconds: float  # between SIGTERM and SIGKILL
    sandbox: str  # "bwrap", "none" or "auto"
    network_isolation: bool
    hide: List[str]  # paths the sandbox hides
    extra_ro: List[str]  # paths the sandbox shows read-only (the environment among them)
    env: Dict[str, str]
    forward_env: List[str]  # names only: the values come from the worker's environment or stdin
    home_dir: str  # the sandbox's home for the run, removed as it ends
    cache_dirs: List[CacheDir]
    project_hidden: List[str]  # project paths the sandbox hides (a local run sees what a remote one gets)
    left_out: List[str]  # those a failure names when its log mentions them


class Job(_JobRequired, total=False):
    project_shown: List[str]  # the project paths shown; one made after the view was taken is hidden
    gpus: JobGpus
    path_prepend: List[str]  # first on the task's PATH
    manifest_copy: str  # where the bucket transport fetches the outputs' manifest from
    checkpoints: Checkpoints
    timeout_message: str  # why the timeout stops the command, when it is not the step's own (a cost cap)


class _StatusFields(TypedDict, total=False):
    """What the worker (or control.py, for a run it ends) writes besides its
    state. Times are ISO 8601 strings; pids and ticks ints, None until known."""

    worker_pid: Optional[int]
    worker_start_ticks: Optional[int]  # the guard against pid reuse (control.start_ticks)
    pid: Optional[int]  # the command's, the leader of its own session
    start_ticks: Optional[int]
    exit_code: Optional[int]
    signal: Optional[str]  # the signal that ended the command, by name
    started_at: Optional[str]
    ended_at: Optional[str]  # also of a `running` run whose worker died: when its guard saw the command gone
    sandbox: Optional[str]  # "bwrap" or "none", as the command was started
    outputs_root: Optional[str]
    message: Optional[str]  # why it failed, said to the user
    mark: str  # in the command's environment (control.RUN_MARK)
    cgroup: Optional[str]
    gpus: List[str]  # the GPUs the run holds
    checkpoints_root: Optional[str]  # where the command writes its checkpoints now (pulled from there)


class Status(_StatusFields):
    """status.json."""

    version: int
    state: str  # control.STATES: starting, running, then how it ended


class StatusAnswer(_StatusFields, total=False):
    """control.py's `status`: the status file and what is true right now.
    Without a status file, or with a damaged one, `state` is None."""

    version: int
    state: Optional[str]
    worker_alive: bool
    exists: bool  # whether the run's folder is there
    damaged: str  # what is wrong with the status file (control.damage_of)
    worker_pids: List[int]  # the workers of a run whose status file is damaged


def job_refusal(raw: Mapping[str, Any]) -> Optional[str]:
    """Why a worker of this release cannot run the job `raw`, or None."""
    version = raw.get("version")
    if version == JOB_VERSION:
        return None
    return (
        "job version %s, this worker reads %d: the client that wrote the job and the worker scripts "
        "it runs come from different releases of substrax-tasks; nothing was run. Tear the run down "
        "(substrax-compute teardown RUN_ID) and run the step again: the client installs its own "
        "worker" % (version if version is not None else "missing", JOB_VERSION)
    )
