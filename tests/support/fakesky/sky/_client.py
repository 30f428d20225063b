"""The SDK calls (sky.launch, sky.get, ...), with SkyPilot 0.14.1's public
signatures. Calls that return a RequestId start a detached request process
and return at once; `get` waits for the result and raises its exception."""

from __future__ import annotations

import builtins
import contextlib
import getpass
import io
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sky import _cluster, exceptions
from sky._server import (
    ACTIVE,
    effective_status,
    request_dir,
    request_lock,
    request_record,
    save_request,
)
from sky._state import read_json, spawn, state_dir, write_json
from sky._types import ClusterStatus, JobStatus, OptimizeTarget, Record, StatusRefreshMode
from sky.server.common import RequestId
from sky.server.requests.requests import RequestStatus
from sky.task import Resources, Task

_POLL = 0.05
_FINAL = (RequestStatus.SUCCEEDED.value, RequestStatus.FAILED.value, RequestStatus.CANCELLED.value)


def _request(name: str, args: dict[str, Any], cluster_name: str | None = None,
             request_id: RequestId | None = None) -> RequestId:  # fmt: skip
    state = state_dir()
    request_id = request_id or RequestId(str(uuid.uuid4()))
    folder = request_dir(state, request_id)
    folder.mkdir(parents=True)
    write_json(folder / "args.json", args, mode=0o600)  # a launch's secrets
    record = {"request_id": request_id, "name": name, "status": RequestStatus.PENDING.value,
              "created_at": time.time(), "finished_at": None, "cluster_name": cluster_name,
              "pid": None, "ticks": None}  # fmt: skip
    save_request(state, record)
    pid, ticks = spawn(state, "request", [request_id], log=folder / "log")
    with request_lock(state, request_id):
        record = request_record(state, request_id) or record
        if record["pid"] is None:
            record.update(pid=pid, ticks=ticks)
            save_request(state, record)
    return request_id


# ------------------------------------------------------------------ clusters


def launch(  # noqa: PLR0917 - SkyPilot's signature
    task: Task,
    cluster_name: str | None = None,
    retry_until_up: bool = False,
    idle_minutes_to_autostop: int | None = None,
    wait_for: Any = None,
    dryrun: bool = False,
    down: bool = False,
    backend: Any = None,
    optimize_target: OptimizeTarget = OptimizeTarget.COST,
    no_setup: bool = False,
    clone_disk_from: str | None = None,
    fast: bool = False,
    resize: bool = False,
) -> RequestId:
    """RequestId of the launch; its result is (job_id, None) once the job is
    submitted (not finished); job_id None when the task has nothing to run."""
    if resize and cluster_name is None:
        raise ValueError("resize=True requires cluster_name to be set to an existing cluster.")
    if clone_disk_from is not None:
        raise NotImplementedError("clone_disk_from is not implemented yet.")
    if cluster_name is None:
        cluster_name = f"sky-{uuid.uuid4().hex[:4]}-{getpass.getuser()}"
    args = {"task_config": task.to_yaml_config(), "cluster_name": cluster_name,
            "idle_minutes_to_autostop": idle_minutes_to_autostop, "down": down, "dryrun": dryrun,
            "no_setup": no_setup}  # fmt: skip
    return _request("launch", args, cluster_name)


def exec(  # SkyPilot's name, a builtin's too
    task: Task, cluster_name: str | None = None, dryrun: bool = False, down: bool = False, backend: Any = None
) -> RequestId:
    """RequestId of the exec; its result is (job_id, None) once the job is
    queued on the UP cluster: workdir synced, no setup, no file mounts."""
    if cluster_name is None:
        raise ValueError("cluster_name must be specified.")
    args = {"task_config": task.to_yaml_config(), "cluster_name": cluster_name, "dryrun": dryrun}
    return _request("exec", args, cluster_name)


def job_status(cluster_name: str, job_ids: list[int] | None = None) -> RequestId:
    return _request("job_status", {"cluster_name": cluster_name, "job_ids": job_ids}, cluster_name)


def queue(cluster_name: str, skip_finished: bool = False, all_users: bool = False) -> RequestId:
    return _request("queue", {"cluster_name": cluster_name, "skip_finished": skip_finished}, cluster_name)


def cancel(
    cluster_name: str, all: bool = False, all_users: bool = False, job_ids: list[int] | None = None
) -> RequestId:
    args = {"cluster_name": cluster_name, "job_ids": job_ids, "all": all or all_users}
    return _request("cancel", args, cluster_name)


def down(
    cluster_name: str, purge: bool = False, graceful: bool = False, graceful_timeout: int | None = None
) -> RequestId:
    return _request("down", {"cluster_name": cluster_name}, cluster_name)


def status(
    cluster_names: list[str] | None = None,
    refresh: StatusRefreshMode = StatusRefreshMode.NONE,
    all_users: bool = False,
) -> RequestId:
    """The fake's records are current but for a cluster taken away behind
    SkyPilot's back (`python -m sky preempt`): as on SkyPilot, that one
    reads UP until a refresh asks the cloud, which removes it."""
    names = None if cluster_names is None else list(cluster_names)
    return _request("status", {"cluster_names": names, "refresh": StatusRefreshMode(refresh).value})


def autostop(  # noqa: PLR0917 - SkyPilot's signature
    cluster_name: str,
    idle_minutes: int,
    wait_for: Any = None,
    down: bool = False,
    hook: str | None = None,
    hook_timeout: int | None = None,
) -> RequestId:
    args = {"cluster_name": cluster_name, "idle_minutes": int(idle_minutes), "down": down}
    return _request("autostop", args, cluster_name)


# ------------------------------------------------------------------ requests


def _decode(name: str, result: Any) -> Any:
    """Results as SkyPilot's client decodes them (enums, records, tuples)."""
    if name == "launch":
        return tuple(result)
    if name == "job_status":
        return {job_id: None if value is None else JobStatus(value) for job_id, value in result}
    if name == "queue":
        return [Record(**{**r, "status": JobStatus(r["status"])}) for r in result]
    if name == "status":
        return [Record(**{**r, "status": ClusterStatus(r["status"]), "handle": _handle(r.get("handle"))})
                for r in result]  # fmt: skip
    return result


def _handle(raw: dict[str, Any] | None) -> Record | None:
    """A cluster's handle as SkyPilot's client has it (a
    CloudVmRayResourceHandle): the launched resources, an object, and nodes."""
    if raw is None:
        return None
    launched = next(iter(Resources.from_yaml_config(raw["launched_resources"])))
    return Record(launched_resources=launched, launched_nodes=int(raw["launched_nodes"]))


def _exception(kind: str, message: str) -> Exception:
    cls = getattr(exceptions, kind, None) or getattr(builtins, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RuntimeError(f"{kind}: {message}")
    return cls(message)


def _resolve(state: Path, request_id: str) -> RequestId:
    """A full request id, from a full id or a unique prefix of one."""
    if (request_dir(state, request_id) / "request.json").exists():
        return RequestId(request_id)
    found = [p.name for p in (state / "requests").glob(f"{request_id}*")] if request_id else []
    if len(found) != 1:
        raise RuntimeError(f"Failed to get request {request_id}: 404 ({len(found)} requests match)")
    return RequestId(found[0])


def get(request_id: RequestId) -> Any:
    """Wait for the request (a full id or a prefix); its result, or its
    exception raised here."""
    state = state_dir()
    request_id = _resolve(state, request_id)
    while True:
        record = request_record(state, request_id)
        if record is None:
            raise RuntimeError(f"Failed to get request {request_id}: 404 request not found")
        current = effective_status(record)
        if current == RequestStatus.CANCELLED.value:
            raise exceptions.RequestCancelled(
                f"Current {record['name']!r} request ({request_id}) is cancelled by another process."
            )
        if current in _FINAL:
            answer = read_json(request_dir(state, request_id) / "result.json")
            if answer is None:
                raise RuntimeError(f"fakesky: request {request_id} ({record['name']}) died without a result")
            if not answer["ok"]:
                raise _exception(answer["type"], answer["message"])
            return _decode(record["name"], answer["result"])
        time.sleep(_POLL)


def _latest_request(state: Path) -> str:
    records = [read_json(p / "request.json") for p in (state / "requests").glob("*")]
    records = [r for r in records if r]
    if not records:
        raise ValueError("No request to stream")
    return str(max(records, key=lambda r: r["created_at"])["request_id"])


def stream_and_get(  # noqa: PLR0917 - SkyPilot's signature
    request_id: RequestId | None = None,
    log_path: str | None = None,
    tail: int | None = None,
    follow: bool = True,
    output_stream: io.TextIOBase | None = None,
    relay_rich_status: bool = False,
) -> Any:
    """Write the request's log to output_stream (stdout) until it ends, then
    `get`; with follow=False, what the log holds now, and None."""
    out: Any = output_stream if output_stream is not None else sys.stdout
    if request_id is None and log_path is not None:
        out.write(Path(log_path).read_text(errors="replace"))
        return None
    state = state_dir()
    request_id = _resolve(state, request_id or _latest_request(state))
    log = request_dir(state, request_id) / "log"
    with _opened(log) as f:
        if tail:
            lines = f.read().decode(errors="replace").splitlines(keepends=True)
            out.write("".join(lines[-tail:]))
        while True:
            record = request_record(state, request_id)
            done = record is None or effective_status(record) in _FINAL or not follow
            chunk = f.read()
            if chunk:
                out.write(chunk.decode(errors="replace"))
                out.flush()
            elif done:
                break
            else:
                time.sleep(_POLL)
    return get(request_id) if follow else None


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    path.touch()
    with path.open("rb") as f:
        yield f


def api_cancel(
    request_ids: RequestId | list[RequestId] | str | list[str] | None = None,
    all_users: bool = False,
    silent: bool = False,
) -> RequestId:
    """RequestId whose result is the list of request ids it cancelled."""
    if isinstance(request_ids, str):
        request_ids = [request_ids]
    ids = None if request_ids is None else [str(r) for r in request_ids]
    request_id = RequestId(str(uuid.uuid4()))  # known before it runs: it never cancels itself
    return _request("api_cancel", {"request_ids": ids, "exclude": request_id}, request_id=request_id)


def api_status(
    request_ids: list[RequestId | str] | None = None,
    all_status: bool = False,
    limit: int | None = None,
    fields: list[str] | None = None,
    cluster_name: str | None = None,
) -> list[Record]:
    """Request records (direct, no request); `status` is the status's value
    (a str), as in SkyPilot's RequestPayload. request_ids are prefixes."""
    state = state_dir()
    records = [read_json(p / "request.json") for p in (state / "requests").glob("*")]
    found = []
    for record in sorted((r for r in records if r), key=lambda r: -r["created_at"]):
        current = effective_status(record)
        if request_ids is not None:
            if not any(record["request_id"].startswith(str(p)) for p in request_ids):
                continue
        elif not all_status and current not in ACTIVE:
            continue
        if cluster_name is not None and record.get("cluster_name") != cluster_name:
            continue
        found.append(Record(
            request_id=record["request_id"], name=record["name"], entrypoint=record["name"],
            request_body="", status=current, created_at=record["created_at"], user_id="fakesky",
            return_value="", error="", pid=record.get("pid"), schedule_type="long",
            user_name=getpass.getuser(), cluster_name=record.get("cluster_name"), status_msg=None,
            should_retry=False, finished_at=record.get("finished_at"), file_mounts_blob_id=None,
        ))  # fmt: skip
    return found[:limit] if limit else found


# ---------------------------------------------------------------------- logs


def tail_logs(
    cluster_name: str,
    job_id: int | None,
    follow: bool,
    tail: int = 0,
    output_stream: io.TextIOBase | None = None,
    *,
    preload_content: bool = True,
) -> int | Iterator[str | None]:
    """Blocking: the job's log to output_stream (stdout); the exit code of
    sky.exceptions.JobExitCode (0, 100 failed, 101 not finished, 102 not
    found, 103 cancelled). preload_content=False: an iterator of log text
    ending with None."""
    if output_stream is not None and not preload_content:
        raise ValueError("output_stream cannot be specified when preload_content is False")
    chunks = _job_log(state_dir(), cluster_name, job_id, follow, tail)
    if not preload_content:
        return (item if isinstance(item, str) else None for item in chunks)
    out: Any = output_stream if output_stream is not None else sys.stdout
    for item in chunks:
        if isinstance(item, int):
            return item
        out.write(item)
        out.flush()
    return int(exceptions.JobExitCode.NOT_FOUND)


def _exit_code(status: JobStatus | None) -> int:
    if status is None:
        return exceptions.JobExitCode.NOT_FOUND
    if not status.is_terminal():
        return exceptions.JobExitCode.NOT_FINISHED
    if status == JobStatus.SUCCEEDED:
        return exceptions.JobExitCode.SUCCEEDED
    if status == JobStatus.CANCELLED:
        return exceptions.JobExitCode.CANCELLED
    return exceptions.JobExitCode.FAILED


def _job_log(state: Path, name: str, job_id: int | None, follow: bool, tail: int) -> Iterator[str | int]:
    """Log text, then the exit code (an int) last."""
    _cluster.require(state, name, "tailing logs")
    if job_id is None:
        known = _cluster.jobs(state, name)
        job_id = int(known[-1]["job_id"]) if known else None
    job = None if job_id is None else read_json(_cluster.job_file(state, name, job_id))
    if job is None or job_id is None:
        yield f"Job {job_id} not found.\n"
        yield int(exceptions.JobExitCode.NOT_FOUND)
        return
    log = _cluster.job_log(state, name, job_id)
    status = _cluster.job_status(job)
    with _opened(log) as f:
        if tail > 0:
            lines = f.read().decode(errors="replace").splitlines(keepends=True)
            yield "".join(lines[-tail:])
        while True:
            job = read_json(_cluster.job_file(state, name, job_id)) or job
            status = _cluster.job_status(job)
            chunk = f.read()
            if chunk:
                yield chunk.decode(errors="replace")
            elif status.is_terminal() or not follow:
                break
            else:
                time.sleep(_POLL)
    yield int(_exit_code(status))
