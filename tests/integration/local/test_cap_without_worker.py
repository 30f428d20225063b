"""A run whose client and worker are both killed (as the OOM killer may)
still ends at its cap and at its timeout: the run's guard (remote/guard.py)
outlives its worker and stops the command's tree at the deadline the worker
had; under bubblewrap the sandbox dies with its worker at once. Real doit of
a real dodo.py, as root and as a user without root; the doit's process
group killed with SIGKILL, then the worker, by the pid its status records.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import DOIT, SANDBOXES, clean_env, compute, make_project, show, wait_for, write_pyproject
from local_runs import marked_pids
from other_user import OtherUser

from substrax_tasks._remote import control

# $1 a second: a cap of $LIMIT falls LIMIT seconds after the launch, as a
# timeout of LIMIT falls LIMIT seconds after the command starts. Long
# enough for the run to be going (and its worker killed) well before it.
HOURLY_COST = 3600.0
LIMIT = 15.0
# The command writes this file if it is still alive that long after its
# start: well past the deadline, and well before its own end.
OUTLIVED_AFTER = LIMIT + 20.0
# How long after the deadline the tree may take to be gone: the guard sees
# the deadline within a poll, then stops the tree as the worker would
# (control.stop_leftovers); a loaded machine is slow at both.
STOP_WAIT = 45.0
# How soon after its deadline the guard has stopped the tree and recorded
# its end: within a poll, then control.stop_leftovers (loaded machine).
GUARD_STOP_SECONDS = 6.0
# How soon a sandbox dies with its worker (--die-with-parent): at once, but
# the machine is loaded.
DIED_WITH_WORKER = 5.0
TOO_SLOW = "the worker was killed too late to prove anything: its own deadline had come (a loaded machine?)"

# The command, and a child of it in a session of its own (as a data loader
# may be): both carry the test's marker in their argv.
COMMAND = f"""
import os, subprocess, sys, time
marker, outlived = sys.argv[1], sys.argv[2]
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker], start_new_session=True)
time.sleep({OUTLIVED_AFTER!r})
try:
    with open(outlived, "w") as f:
        f.write("outlived its deadline")
except OSError:  # under bubblewrap the test's folder is hidden: its pids tell
    pass
time.sleep(300)
"""

STEP = """
def task_long():
    yield from remote_step("long", command={argv!r}, outputs=["out.txt"], {limit})
"""


def child_started(marker: str) -> bool:
    """Whether the command's child runs: by its own argv, not by the marker
    alone, which bubblewrap's argv carries too (a sandbox still being set up,
    its command not started, would count)."""
    child = b"\0import time; time.sleep(300)\0" + marker.encode()
    for pid in marked_pids(marker):
        with contextlib.suppress(OSError):
            if child in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
    return False


def start_doit(root: Path, user: OtherUser | None) -> subprocess.Popen[str]:
    """doit in a process group of its own, as a shell's job is, so that the
    test kills it whole (the spawner of its local runs with it)."""
    if user is None:
        argv, env = [str(DOIT)], clean_env()
    else:
        argv, env = [*user.prefix, user.python, "-m", "doit"], user.env()
    return subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)  # fmt: skip


def status_file(root: Path) -> Path:
    (run,) = [p for p in (root / ".substrax" / "runs").iterdir() if p.is_dir()]
    return run / control.STATUS_FILE


def read_status(root: Path) -> dict[str, Any]:
    try:
        record: dict[str, Any] = json.loads(status_file(root).read_text())
    except (OSError, ValueError):  # not written yet
        return {}
    return record


def runs_status(root: Path, user: OtherUser | None) -> list[dict[str, Any]]:
    """`substrax-compute status --all --json`, as the project's owner runs it."""
    done = compute(root, "status", "--all", "--json") if user is None else user.compute(
        root, "--project", str(root), "status", "--all", "--json")  # fmt: skip
    assert done.returncode == 0, show(done)
    runs: list[dict[str, Any]] = json.loads(done.stdout)["runs"]
    return runs


@contextlib.contextmanager
def killed_mid_run(root: Path, user: OtherUser | None, marker: str) -> Iterator[dict[str, Any]]:
    """Start doit, wait for the command and its child; SIGKILL the doit's
    process group, then the worker (by the pid of its status record). Yields
    that record; whatever is left is stopped by pid at the end."""
    proc = start_doit(root, user)
    try:
        wait_for(lambda: read_status(root).get("state") == "running" and child_started(marker),
                 "the command and its child to run", timeout=90)  # fmt: skip
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        record = read_status(root)
        worker, ticks = record["worker_pid"], record["worker_start_ticks"]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not control.alive(worker, ticks), "the worker to die")
        # Killed before its deadline: else its own timeout, not the guard, ended the run.
        assert read_status(root).get("state") == "running", read_status(root)
        record["killed_at"] = time.time()
        yield record
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for pid in marked_pids(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def project_for(base: Path, user: OtherUser | None, sandbox: str, limit: str, marker: str) -> Path:
    python = sys.executable if user is None else user.python
    argv = [python, "-c", COMMAND, marker, str(base / "outlived.txt")]
    root = make_project(base, STEP.format(argv=argv, limit=limit), ["long"], sandbox=sandbox)
    write_pyproject(root, sandbox, extra=f"hourly_cost = {HOURLY_COST}\n")
    if user is not None:
        user.own(root)
    return root


def started(record: dict[str, Any]) -> float:
    """When the command started (its timeout counts from then), as epoch seconds."""
    return datetime.datetime.fromisoformat(str(record["started_at"])).timestamp()


def wait_tree_gone(marker: str, seconds: float) -> float:
    """Wait for every process of the command to be gone; when that was (time.time())."""
    wait_for(lambda: not marked_pids(marker), "the command's tree to be stopped", timeout=seconds)
    return time.time()


@pytest.fixture(params=["root", "user"])
def runner(request: pytest.FixtureRequest) -> OtherUser | None:
    """doit as root, or as a uid without root (the tests' own user when it is not root)."""
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("DOIT AS ROOT NOT TESTED: the tests run without root")
        return None
    user: OtherUser = request.getfixturevalue("other_user")
    return user


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_the_cap_holds_when_the_client_and_then_the_worker_are_killed(
    tmp_path: Path, marker: str, sandbox: str, runner: OtherUser | None
) -> None:
    """The issue's reproduction: killed at once with bubblewrap (the sandbox
    dies with its worker: the run reads lost, its cost fixed at that moment,
    under the cap); without a sandbox, the guard stops the command (its
    child in another session too) at the cap, and the run reads timed out
    at max_cost, its cost past the cap by no more than the launch's start."""
    base = tmp_path if runner is None else runner.base
    root = project_for(base, runner, sandbox, f"max_cost={LIMIT}", marker)
    with killed_mid_run(root, runner, marker) as record:
        handle = json.loads((status_file(root).parent / "handle.json").read_text())
        capped_at = float(handle["state"]["machine"]["asked_at"]) + LIMIT  # $1 a second from the launch
        assert record["killed_at"] < capped_at - 1, TOO_SLOW
        gone = wait_tree_gone(marker, capped_at - time.time() + STOP_WAIT)
    assert not (base / "outlived.txt").exists()
    (run,) = runs_status(root, runner)
    if sandbox == "bwrap":
        assert gone - record["killed_at"] < DIED_WITH_WORKER, "the sandbox should have died with its worker"
        assert run["state"] == "lost", run
        # the guard stamps the end it saw (within a poll of the tree's death);
        # from then on a lost run's cost no longer grows
        wait_for(lambda: read_status(root).get("ended_at"), "the guard to stamp the run's end", timeout=30)
        (run,) = runs_status(root, runner)
        time.sleep(1.5)
        (again,) = runs_status(root, runner)
        assert run["cost_usd"] == again["cost_usd"] and run["cost_usd"] <= LIMIT, (run, again)
        return
    assert gone >= capped_at - 1, "stopped before its cap: by what?"
    assert run["state"] == "timed_out", run
    assert f"its cost reached max_cost = ${LIMIT:.4f}" in run["message"], run
    assert "its worker was gone, so the run's guard stopped the command" in run["message"], run
    # past the cap only by the moments between the launch and the command's
    # start (its deadline is counted from then; the worker's own stop is as
    # late) and the guard's stop: a few seconds, at $1 a second
    start_delay = started(record) - float(handle["state"]["machine"]["asked_at"])
    assert LIMIT <= run["cost_usd"] <= LIMIT + start_delay + GUARD_STOP_SECONDS, (run, start_delay)
    log = (status_file(root).parent / "run.log").read_text()
    assert f"the worker (pid {record['worker_pid']}) is gone without ending the run" in log, log


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_the_timeout_holds_when_the_client_and_then_the_worker_are_killed(
    tmp_path: Path, marker: str, sandbox: str
) -> None:
    """The same with the step's timeout, as root: without a sandbox the guard
    stops the tree at the timeout and the run reads timed out."""
    root = project_for(tmp_path, None, sandbox, f"timeout={LIMIT}", marker)
    with killed_mid_run(root, None, marker) as record:
        timed_out_at = started(record) + LIMIT
        assert record["killed_at"] < timed_out_at - 1, TOO_SLOW
        gone = wait_tree_gone(marker, timed_out_at - time.time() + STOP_WAIT)
    assert not (tmp_path / "outlived.txt").exists()
    (run,) = runs_status(root, None)
    if sandbox == "bwrap":
        assert gone - record["killed_at"] < DIED_WITH_WORKER, "the sandbox should have died with its worker"
        assert run["state"] == "lost", run
        return
    assert gone >= timed_out_at - 1, "stopped before its timeout: by what?"
    assert run["state"] == "timed_out", run
    assert run["message"].startswith(f"stopped at its timeout of {LIMIT}s; its worker was gone"), run
