"""The fake's "API server": each request, job and autostop timer is a
detached process running this module.

    python -m sky request STATE REQUEST_ID
    python -m sky job     STATE CLUSTER CLUSTER_ID JOB_ID
    python -m sky timer   STATE CLUSTER CLUSTER_ID
    python -m sky cleanup STATE      (stops all of the above; prints JSON)

A request process records itself RUNNING, does the work, and writes
result.json: the result, or the exception's class name and message, which
`sky.get` raises again as that sky.exceptions class. `api_cancel` marks a
request CANCELLED first and then SIGTERMs its process group, so a request
that was cancelled never records a result.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sky import _cluster
from sky._state import alive, cleanup, env_float, locked, own_ticks, read_json, stop_group, write_json
from sky.server.requests.requests import RequestStatus

ACTIVE = (RequestStatus.PENDING.value, RequestStatus.WAITING.value, RequestStatus.RUNNING.value)


def request_dir(state: Path, request_id: str) -> Path:
    return state / "requests" / request_id


def request_lock(state: Path, request_id: str) -> Any:
    return locked(state, f"request-{request_id}")


def request_record(state: Path, request_id: str) -> dict[str, Any] | None:
    record: dict[str, Any] | None = read_json(request_dir(state, request_id) / "request.json")
    return record


def save_request(state: Path, record: dict[str, Any]) -> None:
    write_json(request_dir(state, record["request_id"]) / "request.json", record)


def effective_status(record: dict[str, Any]) -> str:
    """The recorded status; FAILED if its process died without a word."""
    status = str(record["status"])
    if status in ACTIVE and record.get("pid") and not alive(record["pid"], record.get("ticks")):
        return RequestStatus.FAILED.value
    return status


# --------------------------------------------------------------- operations


def _api_cancel(state: Path, request_ids: list[str] | None, exclude: str) -> list[str]:
    if request_ids is None:
        request_ids = [p.name for p in (state / "requests").iterdir() if p.name != exclude]
    cancelled, targets = [], []
    for request_id in request_ids:
        with request_lock(state, request_id):
            record = request_record(state, request_id)
            if record is None or effective_status(record) not in ACTIVE:
                continue
            record.update(status=RequestStatus.CANCELLED.value, finished_at=time.time())
            save_request(state, record)
            cancelled.append(request_id)
            targets.append((record.get("pid"), record.get("ticks")))
    for pid, ticks in targets:
        stop_group(pid, ticks, grace=env_float("FAKESKY_CANCEL_GRACE", 3.0))
    return cancelled


OPERATIONS: dict[str, Callable[..., Any]] = {
    "launch": _cluster.launch,
    "exec": _cluster.exec_task,
    "job_status": _cluster.job_statuses,
    "queue": _cluster.queue,
    "cancel": _cluster.cancel,
    "down": _cluster.teardown,
    "status": _cluster.cluster_records,
    "autostop": _cluster.set_autostop,
    "api_cancel": _api_cancel,
}


def run_request(state: Path, request_id: str) -> int:
    with request_lock(state, request_id):
        record = request_record(state, request_id)
        if record is None or record["status"] != RequestStatus.PENDING.value:
            return 0  # cancelled before it started
        record.update(status=RequestStatus.RUNNING.value, pid=os.getpid(), ticks=own_ticks())
        save_request(state, record)
    args = read_json(request_dir(state, request_id) / "args.json") or {}
    try:
        answer = {"ok": True, "result": OPERATIONS[record["name"]](state, **args)}
    except Exception as exc:  # noqa: BLE001 - every failure is the request's answer
        traceback.print_exc(file=sys.stdout)
        answer = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    with request_lock(state, request_id):
        record = request_record(state, request_id) or record
        if record["status"] == RequestStatus.CANCELLED.value:
            return 0
        write_json(request_dir(state, request_id) / "result.json", answer)
        status = RequestStatus.SUCCEEDED if answer["ok"] else RequestStatus.FAILED
        record.update(status=status.value, finished_at=time.time())
        save_request(state, record)
    return 0


def main(argv: list[str]) -> int:
    role, state, *args = argv
    path = Path(state)
    if role == "request":
        return run_request(path, args[0])
    if role == "job":
        return _cluster.run_job(path, args[0], args[1], int(args[2]))
    if role == "timer":
        return _cluster.timer_loop(path, args[0], args[1])
    if role == "preempt":  # a test takes a cluster away, as a spot preemption or a cancelled allocation does
        _cluster.preempt(path, args[0])
        return 0
    if role == "cleanup":
        print(json.dumps(cleanup(path.parent)))
        return 0
    raise SystemExit(f"unknown role {role!r}")
