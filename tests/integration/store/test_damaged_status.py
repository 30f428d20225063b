"""A damaged status.json of a run (issue 18, item 8): the rerun and
`substrax-compute status` say so, never with a traceback, and never start a
second run beside a worker still going; once the worker is gone the run
reads as lost and the step is launched again.

Real `doit` and `substrax-compute`, a real worker; the client is killed
(-9) mid-run, as a crash would leave it, and the file is damaged by hand.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from dodo_helpers import (
    compute,
    compute_status,
    doit,
    make_project,
    pid_alive,
    popen_doit,
    run_count,
    run_dirs,
    show,
    stop,
    wait_for,
)
from ssh_helpers import (
    launched_status,
    make_ssh_project,
    needs_root,
    needs_sshd,
    only_handle,
    remote_run_dir,
)
from testbeds.sshd_host import SshHost

# Slow while the file flags/slow exists (in an input folder, the run's view;
# the rerun that finds the damaged status sees it unchanged: the same key).
BODY = """
def task_step():
    yield from remote_step(
        "step",
        command=["sh", "-c", "if [ -e flags/slow ]; then sleep 60; fi; echo ok > out.txt", {marker!r}],
        inputs=["flags/"],
        outputs=["out.txt"],
    )
"""
DAMAGES = [
    pytest.param(lambda text: text[:30], "is not a JSON object", id="truncated"),
    pytest.param(lambda text: "\x00" * 64, "is not a JSON object", id="zeroed"),
    pytest.param(
        lambda text: json.dumps({**json.loads(text), "started_at": 5}),
        "has started_at = 5, not a string",
        id="wrong-type",
    ),
    pytest.param(
        lambda text: json.dumps({**json.loads(text), "state": "runnin"}),
        "names no state the worker writes (state 'runnin')",
        id="unknown-state",
    ),
]


@pytest.mark.parametrize(("damage", "said"), DAMAGES)
def test_a_damaged_status_of_a_live_run_is_an_error_then_lost_once_its_worker_is_gone(
    tmp_path: Path, marker: str, damage: Callable[[str], str], said: str
) -> None:
    root = make_project(tmp_path, BODY.format(marker=marker), default_tasks=["step"],
                        files={"flags/slow": ""})  # fmt: skip
    def status_file() -> Path | None:
        return next(iter(d / "status.json" for d in run_dirs(root)), None)

    client = popen_doit(root)
    try:
        wait_for(
            lambda: (f := status_file()) is not None and f.exists() and '"running"' in f.read_text(),
            "the run to be running",
        )
    finally:
        client.send_signal(signal.SIGKILL)  # a client that crashed: the run goes on
        stop(client)
    path = status_file()
    assert path is not None
    text = path.read_text()
    worker = json.loads(text)["worker_pid"]
    path.write_text(damage(text))

    rerun = doit(root)
    output = rerun.stdout + rerun.stderr
    assert rerun.returncode == 1, show(rerun)
    told = f"its status file {path} {said}, and its worker (pid {worker}) is still going"
    assert told in output, show(rerun)
    assert f"Stop that worker (kill {worker})" in output and "Traceback" not in output, show(rerun)
    assert run_count(root) == 1  # no second run beside the first

    listed = compute(root, "status")
    assert listed.returncode == 1, show(listed)
    assert f"{said}, and its worker (pid {worker}) is still going" in listed.stderr, show(listed)
    assert "Traceback" not in listed.stderr

    os.kill(worker, signal.SIGKILL)  # as the message says (-9: it cannot mend the file itself)
    wait_for(lambda: not pid_alive(worker), "the worker to go")
    (run,) = compute_status(root)
    assert run["state"] == "lost", run
    assert run["message"] == f"its status file {path} {said}, and no worker of it is going"

    (root / "flags" / "slow").unlink()
    again = doit(root)
    assert again.returncode == 0, show(again)
    assert "new run" in again.stdout and (root / "out.txt").read_text() == "ok\n"
    assert run_count(root) == 2


@needs_sshd
@needs_root
def test_a_damaged_status_on_an_ssh_host_names_the_host_then_lost_once_its_worker_is_gone(
    tmp_path: Path, host: SshHost
) -> None:
    root = make_ssh_project(tmp_path, host, BODY.format(marker="ssh"), files={"flags/slow": ""})
    client = popen_doit(root)
    try:
        wait_for(lambda: (launched_status(root) or {}).get("state") == "running", "the run to be running")
    finally:
        client.send_signal(signal.SIGKILL)
        stop(client)
    path = remote_run_dir(only_handle(root)) / "status.json"
    worker = json.loads(path.read_text())["worker_pid"]
    path.write_text("{")

    rerun = doit(root)
    assert rerun.returncode == 1, show(rerun)
    said = f"its status file {path} is not a JSON object, and its worker (pid {worker} on {host.address})"
    assert said in rerun.stdout + rerun.stderr and "Traceback" not in rerun.stderr, show(rerun)
    assert run_count(root) == 1

    os.kill(worker, signal.SIGKILL)  # the host is this machine, in a network namespace of its own
    wait_for(lambda: not pid_alive(worker), "the worker to go")
    assert [run["state"] for run in compute_status(root)] == ["lost"]
    (root / "flags" / "slow").unlink()
    again = doit(root)
    assert again.returncode == 0, show(again)
    assert (root / "out.txt").read_text() == "ok\n" and run_count(root) == 2
