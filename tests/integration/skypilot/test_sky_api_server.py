"""A real local SkyPilot API server, reached through SkyClient as the backend
reaches it: errors by SkyPilot's class name, a launch request's lifecycle,
and a cancelled launch.

The server runs in a throwaway HOME and in a network namespace of its own
(loopback only; tests/support/sky_real.py), with no cloud credentials: a launch
fails with NoCloudAccessError. To hold a launch RUNNING long enough to
cancel it, ~/.slurm/config names a login node and the server's PATH starts
with an `ssh` that just waits: SkyPilot's Slurm credential check blocks in
it (no traffic at all). The fixture stops the server with SIGINT first, so
that its executors exit and the named semaphores (/dev/shm/sem.mp-*) go
with them, and fails if they stay; then `sky api stop`, which leaves helper
processes behind for ~30 s; then it kills, by pid, everything in the
server's tree, session and namespace, and fails if anything survives.

About 30 s of CPU (the server's workers and each helper import sky); deselect
with `-m "not sky_server"`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sky_real import (
    SSH_STARTED,
    SkyServer,
    blocking_ssh,
    needs_sky_server,
    read_json,
    running_server,
    slurm_login_node,
    wait_for_log,
    wait_path,
)

from substrax_tasks.backends.skypilot.backend import LAUNCH_REQUEST
from substrax_tasks.backends.skypilot.client import SkyCallError, SkyClient
from substrax_tasks.backends.skypilot.settings import TABLE
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.project import Project

# On a busy 2-core machine the server alone can take a minute to start its workers.
pytestmark = [needs_sky_server, pytest.mark.sky_server, pytest.mark.timeout(300)]

MISSING = "substrax-no-such-cluster"
BOOT_CHECK_DONE = "Request skypilot-server-on-boot-check finished"
CALL_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkyServer]:
    root = tmp_path_factory.mktemp("sky-server")
    ssh_bin, _ = blocking_ssh(root)
    with running_server(root, path_prepend=[ssh_bin]) as started:
        yield started


def _task(infra: str) -> dict[str, Any]:
    return {"name": "substrax-api-test", "num_nodes": 1, "resources": {"infra": infra, "cpus": "1+"},
            "setup": "true\n", "run": "echo hello\n"}  # fmt: skip


def _launch_request(tmp: Path, name: str, infra: str) -> dict[str, Any]:
    """As SkypilotBackend.launch sends it."""
    return {
        "task": _task(infra),
        "cluster_name": f"substrax-api-{name}",
        "idle_minutes_to_autostop": 5,
        "down": True,
        "retry_until_up": False,
        "request_file": str(tmp / f"{name}-request.json"),
        "log_file": str(tmp / f"{name}.log"),
        "secrets": {},
    }


def _kind(client: SkyClient, operation: str, request: dict[str, Any]) -> str:
    try:
        result = client.call(operation, request, timeout=CALL_TIMEOUT)
    except SkyCallError as exc:
        return exc.kind
    return f"no error: {result!r}"


def _statuses(client: SkyClient, *rids: str) -> dict[str, tuple[str, str]]:
    records = client.call("request_status", {"request_ids": list(rids)}, timeout=CALL_TIMEOUT)
    return {r["request_id"]: (r["name"], r["status"]) for r in records}


def _project(root: Path, server: SkyServer) -> Project:
    root.mkdir()
    (root / "pyproject.toml").write_text(
        f'[{TABLE}]\nsky_python = "{server.python}"\ninfra = "slurm"\n[{TABLE}.copy]\n'
    )
    return Project.open(root)


def test_skypilot_api_server_through_sky_client(
    server: SkyServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = SkyClient(str(server.python), server.env)

    # A cluster that does not exist, and a launch with no cloud to go to, in
    # the calls the backend makes: three helper processes at once (each
    # spends ~3 s importing sky).
    failed = _launch_request(tmp_path, "no-cloud", "aws")
    with ThreadPoolExecutor(3) as pool:
        kinds = dict(zip(
            ["job_status", "down", "launch"],
            pool.map(lambda call: _kind(client, *call), [
                ("job_status", {"cluster_name": MISSING, "job_ids": [1]}),
                ("down", {"cluster_name": MISSING}),
                ("launch", failed),
            ]),
            strict=True,
        ))  # fmt: skip
    assert kinds == {
        "job_status": "ClusterDoesNotExist",
        "down": "ClusterDoesNotExist",
        "launch": "NoCloudAccessError",
    }
    failed_rid = read_json(Path(failed["request_file"]))["request_id"]
    assert Path(failed["log_file"]).is_file()  # its log holds spinners only

    # A launch held RUNNING in SkyPilot's Slurm check, then cancelled. The
    # server's own check at boot must be over first, or it would run ssh.
    wait_for_log(server.log, BOOT_CHECK_DONE, 90)
    slurm_login_node(server.home)
    ssh_started = server.root / SSH_STARTED
    held = _launch_request(tmp_path, "held", "slurm")
    outcome: dict[str, str] = {}
    waiter = threading.Thread(target=lambda: outcome.update(kind=_kind(client, "launch", held)), daemon=True)
    waiter.start()
    wait_path(Path(held["request_file"]), 60, "the launch request's id")
    wait_path(ssh_started, 90, "SkyPilot's Slurm check to run ssh")
    held_rid = read_json(Path(held["request_file"]))["request_id"]
    assert _statuses(client, failed_rid, held_rid) == {
        failed_rid: ("sky.launch", "FAILED"),
        held_rid: ("sky.launch", "RUNNING"),
    }

    cancelled = client.call("api_cancel", {"request_ids": [held_rid]}, timeout=CALL_TIMEOUT)
    assert cancelled == [held_rid]
    waiter.join(CALL_TIMEOUT)
    assert outcome == {"kind": "RequestCancelled"}, "the waiting launch sees the cancel"

    # The backend reads a run whose launch request this was as cancelled.
    project = _project(tmp_path / "project", server)
    handle = project.new_run(make_spec("train", ["true"], project.root), "skypilot")
    (project.store.run_dir(handle.run_id) / LAUNCH_REQUEST).write_text(
        f'{{"request_id": "{held_rid}", "name": "launch"}}'
    )
    for name, value in server.env.items():
        if name.startswith("SKYPILOT_") or name == "HOME":
            monkeypatch.setenv(name, value)
    status = project.backend_for(handle).poll(handle)
    assert (status.state, status.message) == ("cancelled", f"launch request {held_rid}: CANCELLED")
