#!/usr/bin/env python3
"""SkyPilot's public SDK, one call per process, JSON in and out.

Runs in SkyPilot's own interpreter (the `sky_python` setting), never in
substrax_tasks' process: `import sky` takes seconds, writes ~/.sky and pins
its own dependencies. Stdlib + sky only, Python 3.9+ (SkyPilot's own
floor). A script, not a module of the package: nothing imports it, and its
folder holds no other Python file, so that none can shadow a module of
SkyPilot's from the folder Python puts first on a script's sys.path. Its
strict mypy check runs against SkyPilot's venv (mypy.ini beside it).

    python sky_sdk.py OPERATION  < request.json  > answer (one JSON line)

The answer is `{"ok": true, "result": ...}`, or `{"ok": false, "error":
{"type": <exception class>, "message": ...}}` with exit code 1. Records are
SkyPilot's own, made JSON-able (enums by name); nothing parses `sky` CLI
output. A request id is written to `request_file` (atomically) the moment
SkyPilot hands it out, before anything waits on it, so a client killed
while waiting leaves the id behind for `cancel` to find.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import sky
import sky.exceptions  # exceptions are named in answers

if TYPE_CHECKING:
    from sky.server.common import RequestId

# A request as the client sends it: JSON, read as SkyPilot's SDK takes it.
Request = dict[str, Any]
T = TypeVar("T")


def jsonable(value: object) -> object:  # noqa: PLR0911 - one return per kind of value
    """SkyPilot's records as JSON: enums by name, objects by their fields."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "model_dump"):  # pydantic records (api_status payloads)
        return jsonable(value.model_dump())
    if hasattr(value, "__dict__"):
        return {k: jsonable(v) for k, v in vars(value).items() if not k.startswith("_")}
    return str(value)


def write_atomic(path: str, data: dict[str, str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=Path(path).absolute().parent, prefix=".request-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    Path(tmp).replace(path)


def _record_request(request: Request, request_id: str, name: str) -> None:
    path = request.get("request_file")
    if path:
        write_atomic(path, {"request_id": str(request_id), "name": name})


def _wait(request: Request, request_id: RequestId[T]) -> T:
    """Wait for a request, its log going to `log_file` when one is named."""
    log_file = request.get("log_file")
    if not log_file:
        return sky.get(request_id)
    with Path(log_file).open("a") as out:
        return sky.stream_and_get(request_id, output_stream=out)


class TaskRefused(Exception):
    """SkyPilot refused the task before anything was launched; the message
    is `<SkyPilot's exception class>: <its message>`."""


def op_launch(request: Request) -> object:
    """With `validate` (op_validate's request, less the task), the task is
    checked first, in this process: not a helper process of its own that
    imports sky before the launch."""
    secrets = request.get("secrets") or {}
    try:
        # Secrets come on stdin, never from the task file on disk.
        task = sky.Task.from_yaml_config(request["task"], secrets_overrides=list(secrets.items()) or None)
        if request.get("validate") is not None:
            _validate(task, request["validate"])
    except Exception as exc:
        if request.get("validate") is None:
            raise
        raise TaskRefused(f"{type(exc).__name__}: {exc}") from exc
    request_id = sky.launch(
        task,
        cluster_name=request["cluster_name"],
        retry_until_up=bool(request.get("retry_until_up", False)),
        idle_minutes_to_autostop=request.get("idle_minutes_to_autostop"),
        down=bool(request.get("down", True)),
    )
    _record_request(request, request_id, "launch")
    launched = _launched(request, _wait(request, request_id))
    return {**launched, "hourly_cost": launched_price(request["cluster_name"])}


def _launched(request: Request, result: object) -> dict[str, object]:
    """The launch's job; with `write_ssh_config`, the cluster's ssh config
    written too, in this process (`ssh_config` below): not a second helper
    process that imports sky again before the first ssh call."""
    job_id = None
    if isinstance(result, (tuple, list)) and result:
        job_id = result[0]
    answer: dict[str, object] = {"job_id": job_id}
    if request.get("write_ssh_config"):
        try:
            answer["ssh_config"] = _write_ssh_config(request["cluster_name"])
        except Exception as exc:  # noqa: BLE001 - the launch stands; the client writes it again
            answer["ssh_config_error"] = f"{type(exc).__name__}: {exc}"
    return answer


def launched_price(name: str) -> float | None:
    """The catalog's price in USD an hour of the cluster `name` as launched:
    its handle's launched resources on its nodes, as `sky cost-report`
    prices them; None where the catalog lists none (SkyPilot prices
    Kubernetes and Slurm at 0) or it cannot be read: a price is never
    worth failing a launch that succeeded."""
    try:
        records = sky.get(sky.status(cluster_names=[name])) or []
        handle = field(records[0], "handle") if records else None
        launched = getattr(handle, "launched_resources", None)
        if launched is None or not launched.is_launchable():
            return None
        price = float(launched.get_cost(3600)) * int(getattr(handle, "launched_nodes", 1) or 1)
    except Exception:  # noqa: BLE001 - see above
        return None
    return price or None


def op_wait_launch(request: Request) -> object:
    """Reattach to a launch request a killed client left running, by the
    id `launch` wrote down (a plain str: SkyPilot's RequestId is a str
    subclass typed by the request's result)."""
    result = _launched(request, _wait(request, request["request_id"]))
    name = request.get("cluster_name")
    return {**result, "hourly_cost": launched_price(str(name))} if name else result


def op_request_status(request: Request) -> object:
    records = sky.api_status(request_ids=list(request["request_ids"]), all_status=True)
    return [
        {"request_id": record.request_id, "name": record.name, "status": jsonable(record.status)}
        for record in records
    ]


def op_api_cancel(request: Request) -> object:
    return jsonable(sky.get(sky.api_cancel(list(request["request_ids"]), silent=True)))


def op_job_status(request: Request) -> object:
    statuses = sky.get(sky.job_status(request["cluster_name"], job_ids=list(request["job_ids"])))
    return {str(k): jsonable(v) for k, v in (statuses or {}).items()}


def op_cancel(request: Request) -> object:
    return jsonable(sky.get(sky.cancel(request["cluster_name"], job_ids=list(request["job_ids"]))))


def op_down(request: Request) -> object:
    request_id = sky.down(request["cluster_name"])
    _record_request(request, request_id, "down")
    return jsonable(sky.get(request_id))


def op_autostop(request: Request) -> object:
    return jsonable(sky.get(sky.autostop(
        request["cluster_name"], int(request["idle_minutes"]), down=bool(request.get("down", True)))))


def op_cluster_status(request: Request) -> object:
    """The named clusters' records; every cluster of this user's without names.

    With `refresh`, SkyPilot first asks the cloud what it holds
    (StatusRefreshMode.FORCE): without it, a cluster lost behind its back
    (a spot preemption, a Slurm allocation cancelled) reads UP from
    SkyPilot's own record until something refreshes it."""
    names = request.get("cluster_names")
    refresh = sky.StatusRefreshMode.FORCE if request.get("refresh") else sky.StatusRefreshMode.NONE
    records = sky.get(sky.status(cluster_names=None if names is None else list(names), refresh=refresh))
    return [{"name": field(r, "name"), "status": jsonable(field(r, "status"))} for r in (records or [])]


def field(record: object, name: str) -> object:
    """A field of a record that is a dict in some releases, a model in others."""
    if isinstance(record, dict):
        return record.get(name)
    return getattr(record, name, None)


def op_hourly_price(request: Request) -> object:
    """The catalog's price in USD an hour of the `resources` asked for,
    the dearest of their choices, when each names a cloud and an instance
    type (else none is known before SkyPilot's optimizer chooses)."""
    choices = sky.Resources.from_yaml_config(request["resources"])
    prices = []
    for resources in choices if isinstance(choices, (set, list)) else [choices]:
        if not resources.is_launchable():
            return {"hourly_cost": None}
        prices.append(float(resources.get_cost(3600)) * int(request.get("num_nodes", 1)))
    return {"hourly_cost": (max(prices) if prices else 0.0) or None}


def op_tail_logs(request: Request) -> object:
    with Path(request["output_file"]).open("a") as out:
        code = sky.tail_logs(request["cluster_name"], request["job_id"], bool(request.get("follow")),
                             tail=int(request.get("tail", 0)), output_stream=out)
    return {"exit_code": code}


def op_ssh_config(request: Request) -> object:
    """The ssh config for a cluster (`ssh -F FILE CLUSTER`).

    With `write`, (re)written first as the `sky status` command writes it on
    the client: with SkyPilot's proxy where the cluster needs one (a Slurm
    cluster's ssh goes through the API server into the job's allocation,
    where the session lands in the cluster's own home; Kubernetes' pods
    likewise). A local API server writes one itself while it provisions, but
    for Slurm that one logs into the login node, in the user's own home, and
    a remote API server writes none here. The SDK has no call for this in
    0.14 (the CLI's helper, a TODO to move into the SDK): without it, the
    config already there is all there is.
    """
    name = request["cluster_name"]
    if request.get("write"):
        return {"path": _write_ssh_config(name)}
    path = _ssh_config_path(name)
    return {"path": str(path) if path.is_file() else None}


def _ssh_config_path(name: str) -> Path:
    return Path("~", ".sky", "generated", "ssh", name).expanduser()


def _write_ssh_config(name: str) -> str | None:
    """(Re)write the cluster's ssh config as `sky status` does; its path, None if there is none."""
    writer = None
    try:
        from sky.client.cli import command as cli

        writer = getattr(cli, "_get_cluster_records_and_set_ssh_config", None)
    except ImportError:
        pass
    if writer is not None:
        import contextlib

        with contextlib.redirect_stdout(sys.stderr):  # one JSON line on stdout, nothing else
            writer([name])
    path = _ssh_config_path(name)
    return str(path) if path.is_file() else None


def op_validate(request: Request) -> object:
    """The task config as SkyPilot reads it, checked offline; and, for bucket
    mounts, whether the chosen cloud can mount buckets at all."""
    _validate(sky.Task.from_yaml_config(request["task"]), request)
    return {"valid": True}


def _validate(task: sky.Task, request: Request) -> None:
    # The backend asks for its local sources to be checked too (they exist by then).
    task.validate(skip_file_mounts=not request.get("check_file_mounts"), skip_workdir=True)
    if request.get("needs_storage_mounting"):
        from sky import clouds

        for resources in task.resources:
            cloud = resources.cloud
            if cloud is None:
                continue
            cloud.check_features_are_supported(
                resources, {clouds.CloudImplementationFeatures.STORAGE_MOUNTING})


OPERATIONS: dict[str, Callable[[Request], object]] = {
    "launch": op_launch,
    "wait_launch": op_wait_launch,
    "request_status": op_request_status,
    "api_cancel": op_api_cancel,
    "job_status": op_job_status,
    "cancel": op_cancel,
    "down": op_down,
    "autostop": op_autostop,
    "cluster_status": op_cluster_status,
    "tail_logs": op_tail_logs,
    "ssh_config": op_ssh_config,
    "validate": op_validate,
    "hourly_price": op_hourly_price,
}


def die_with_parent() -> None:
    """A client killed while it waits takes this helper along (Linux); the
    request itself goes on in SkyPilot's API server, its id on disk."""
    parent = os.getppid()
    try:
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request was made
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    die_with_parent()
    if len(args) != 1 or args[0] not in OPERATIONS:
        sys.stderr.write(f"usage: sky_sdk.py {{{','.join(sorted(OPERATIONS))}}} < request.json\n")
        return 2
    request = json.load(sys.stdin)
    try:
        result = OPERATIONS[args[0]](request)
    except Exception as exc:  # noqa: BLE001 - every failure is answered, by its SkyPilot type
        answer = {"ok": False, "error": {
            "type": type(exc).__name__,
            "module": type(exc).__module__,
            "message": str(exc) or repr(exc),
            "traceback": traceback.format_exc()[-4000:],
        }}
        sys.stdout.write(json.dumps(answer) + "\n")
        return 1
    sys.stdout.write(json.dumps({"ok": True, "result": jsonable(result)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
