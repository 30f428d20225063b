"""remote/worker.py run directly, as a child of the test, under this Python
and under Python 3.8 (the oldest a remote host may have)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from local_runs import (
    GRACE,
    PY38,
    SANDBOXES,
    WAIT,
    WORKER,
    describe,
    marked_pids,
    read_pid_sid,
    ready_files,
    stubborn_tree,
    wait_for,
)

from substrax_tasks._remote import control, runfiles
from substrax_tasks.backends.job import WorkerPaths, build_job
from substrax_tasks.backends.remote_run import script_digests
from substrax_tasks.backends.scripts import REMOTE_SCRIPTS
from substrax_tasks.step.spec import make_spec


@pytest.fixture(params=["python-current", "python-3.8"])
def worker_python(request: pytest.FixtureRequest) -> str:
    if request.param == "python-3.8":
        if not PY38.exists():
            pytest.skip(f"PYTHON 3.8 NOT FOUND at {PY38}: the worker is not tested on Python 3.8")
        return str(PY38)
    return sys.executable


class Job:
    """A job file for the worker, made by the same code the backends use."""

    def __init__(
        self,
        tmp_path: Path,
        argv: Sequence[str],
        *,
        sandbox: str = "none",
        outputs: Sequence[str] = (),
        timeout: float | None = None,
        hide: Sequence[str] = (),
        project: Path | None = None,
    ) -> None:
        self.project = project or tmp_path / "project"
        self.project.mkdir(parents=True, exist_ok=True)
        self.run_dir = tmp_path / "run"
        paths = WorkerPaths(project=str(self.project), run_dir=str(self.run_dir))
        spec = make_spec("job", list(argv), self.project, outputs=outputs, timeout=timeout)
        self.data: runfiles.Job = build_job(
            spec, paths, sandbox=sandbox, network_isolation=False, grace_seconds=GRACE, hide=list(hide)
        )
        self.run_dir.mkdir(parents=True)
        self.path = Path(paths.job)
        self.path.write_text(json.dumps(self.data))
        self.status_file = Path(paths.status)
        self.log_file = Path(paths.log)

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.status_file.read_text())
        return data

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")

    def started(self) -> bool:
        """The worker has written a status past `starting` (it has a pid)."""
        try:
            return self.status().get("state") not in (None, "starting")
        except (OSError, ValueError):
            return False

    def outputs_root(self) -> Path:
        return Path(self.status()["outputs_root"])

    def start(self, python: str, **popen: Any) -> subprocess.Popen[bytes]:
        return subprocess.Popen([python, str(WORKER), str(self.path)], stdin=subprocess.DEVNULL, **popen)


def finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the worker did not exit within {WAIT:.0f} s")


def test_worker_runs_command_and_writes_status(tmp_path: Path, worker_python: str) -> None:
    job = Job(tmp_path, ["sh", "-c", "echo to-stdout; echo to-stderr >&2; exit 3"])
    proc = job.start(worker_python)
    assert finish(proc) == 0  # the worker's own exit: it did its job
    status = job.status()
    assert status["state"] == "failed"
    assert status["exit_code"] == 3
    assert status["worker_pid"] == proc.pid
    assert isinstance(status["pid"], int)
    assert status["started_at"] <= status["ended_at"]
    assert status["sandbox"] == "none"
    log = job.log()
    assert "to-stdout" in log
    assert "to-stderr" in log
    assert not list(job.run_dir.glob("*.tmp"))  # atomic writes leave no temp file
    assert job.status_file.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("detach", [False, True], ids=["attached", "detached"])
def test_a_job_of_another_version_is_refused_by_name_and_nothing_runs(
    tmp_path: Path, worker_python: str, detach: bool
) -> None:
    """A worker on a host given a job written by another release of the
    client (here: a newer one) runs nothing, and says why where the client
    looks: the run's status (failed), its log, and stderr."""
    job = Job(tmp_path, ["sh", "-c", "touch ran"])
    newer = runfiles.JOB_VERSION + 1
    job.data["version"] = newer
    job.path.write_text(json.dumps(job.data))
    argv = [worker_python, str(WORKER), str(job.path), *(["--detach"] if detach else [])]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=WAIT,
                          check=False)  # fmt: skip
    said = f"job version {newer}, this worker reads {runfiles.JOB_VERSION}: "
    assert done.returncode == 1, done.stderr
    assert said in done.stderr
    status = job.status()
    assert status["state"] == "failed"
    assert said in status["message"]
    assert status["version"] == runfiles.STATUS_VERSION
    assert said in job.log()
    assert not (job.project / "ran").exists()


def test_the_status_a_worker_writes_has_every_field_of_its_definition(tmp_path: Path) -> None:
    """remote/runfiles.py's Status is what the worker writes, not a copy
    of it that could drift: every field it has is declared there."""
    job = Job(tmp_path, ["true"], outputs=[])
    assert finish(job.start(sys.executable)) == 0
    status = job.status()
    assert status["version"] == runfiles.STATUS_VERSION
    declared = set(runfiles.Status.__annotations__) | set(runfiles.StatusAnswer.__annotations__)
    assert set(status) <= declared, set(status) - declared
    assert set(job.data) <= set(runfiles.Job.__annotations__)


def test_a_status_file_of_another_version_reads_as_damaged_naming_both_versions(tmp_path: Path) -> None:
    job = Job(tmp_path, ["true"])
    job.status_file.write_text(json.dumps({"version": runfiles.STATUS_VERSION + 1, "state": "succeeded"}))
    answer = control.status(str(job.run_dir))
    assert answer["state"] is None
    said = f"is of version {runfiles.STATUS_VERSION + 1}, and this reads version {runfiles.STATUS_VERSION}"
    assert said in (answer.get("damaged") or "")


def test_every_module_of_remote_is_shipped_and_checked() -> None:
    """A host gets (and CHECKED_RUN checks) every remote/*.py, runfiles.py
    among them: the worker imports it, so a list that missed it would
    break every run there."""
    assert set(REMOTE_SCRIPTS) == {p.name for p in WORKER.parent.glob("*.py")}
    assert {"worker.py", "control.py", "runfiles.py"} <= set(REMOTE_SCRIPTS)
    assert set(script_digests()) == set(REMOTE_SCRIPTS)


def test_worker_task_runs_in_its_own_session(tmp_path: Path, worker_python: str) -> None:
    job = Job(tmp_path, ["sh", "-c", 'echo "$$ $(cut -d " " -f 6 /proc/$$/stat)" > out/me'], outputs=["out/"])
    assert finish(job.start(worker_python)) == 0
    assert job.status()["state"] == "succeeded"
    pid, sid = read_pid_sid(job.outputs_root() / "out" / "me")
    assert pid == sid


def test_worker_never_holds_pipes_for_the_task(tmp_path: Path, worker_python: str, marker: str) -> None:
    """The task's output goes to the log file, never through a pipe the
    worker holds: a background process of the task that keeps its stdout
    and stderr open makes nobody wait, and is killed when the task ends."""
    script = 'sh -c "while :; do sleep 1; done" "$0" & echo started'
    job = Job(tmp_path, ["sh", "-c", script, marker])
    proc = job.start(worker_python, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the worker's pipes stayed open: something held them")
    assert proc.returncode == 0
    assert out == b""
    assert err == b""  # the worker's own stderr goes to the log too
    assert job.status()["state"] == "succeeded"
    assert "started" in job.log()
    assert re.search(r"killing \d+ process\(es\) the command left running", job.log())
    assert not marked_pids(marker), describe(marked_pids(marker))


def test_worker_kills_what_a_finished_task_left_behind(
    tmp_path: Path, worker_python: str, marker: str
) -> None:
    """A double-forked, setsid daemon of a task that exited 0 is found (the
    worker is a child subreaper) and killed."""
    script = '( setsid sh -c "trap \\"\\" TERM; while :; do sleep 1; done" "$0" & ); sleep 0.2'
    job = Job(tmp_path, ["sh", "-c", script, marker])
    assert finish(job.start(worker_python)) == 0
    assert job.status()["state"] == "succeeded"
    assert not marked_pids(marker), describe(marked_pids(marker))


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"]
)
@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_worker_stops_whole_tree_on_signal(
    tmp_path: Path, worker_python: str, marker: str, sandbox: str, sig: signal.Signals
) -> None:
    job = Job(tmp_path, stubborn_tree(marker, "grandchild"), sandbox=sandbox, outputs=["out/"])
    proc = job.start(worker_python)
    wait_for(job.started, "the worker's first status")
    task_ready, grandchild_ready = ready_files(job.outputs_root(), "grandchild")
    wait_for(lambda: task_ready.exists() and grandchild_ready.exists(), "the task tree to start")
    proc.send_signal(sig)
    assert finish(proc) == 0
    # By the time the worker has exited: final status written, tree gone.
    status = job.status()
    assert status["state"] == "cancelled"
    assert status["ended_at"]
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert f"stopping the task tree ({sig.name})" in job.log()


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_worker_timeout_kills_tree(tmp_path: Path, worker_python: str, marker: str, sandbox: str) -> None:
    job = Job(tmp_path, stubborn_tree(marker, "grandchild"), sandbox=sandbox, outputs=["out/"], timeout=1.0)
    assert finish(job.start(worker_python)) == 0
    status = job.status()
    assert status["state"] == "timed_out"
    assert status["ended_at"]
    assert not marked_pids(marker), describe(marked_pids(marker))
    assert "timeout of 1.0s" in job.log()


# Forks and exits at once, again and again: a "pid hopper" whose live
# process is always one its killer has not seen yet. Each generation lives
# for microseconds (too short to be found by its argv), so each one adds a
# byte to out/beats: while that file grows, a hopper is alive.
# It stops once the file named by its argument exists: the test's own way
# to end one that outlived its run.
HOPPER = """
import os, sys
os.makedirs("out", exist_ok=True)
beats = os.open("out/beats", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
while not os.path.exists(sys.argv[1]):
    os.write(beats, b".")
    if os.fork():
        os._exit(0)
"""


def beats(job: Job) -> int:
    try:
        return (job.outputs_root() / "out" / "beats").stat().st_size
    except (OSError, ValueError, KeyError, TypeError):  # no status, or no outputs_root yet
        return 0


# The worker where it can make no cgroup: every cgroup mount covered by an
# empty tmpfs, in a mount namespace of its own.
NO_CGROUP = ["unshare", "--mount", "--propagation", "private",
             "sh", "-c", 'mount -t tmpfs none /sys/fs/cgroup && exec "$@"', "sh"]  # fmt: skip


def run_hopper(tmp_path: Path, sandbox: str, cgroup: bool, ending: str, hopper: str = HOPPER) -> None:
    """Run the hopper under the worker, end the run as `ending` says and
    check that no hopper is left."""
    if os.geteuid() != 0:
        pytest.skip("PID HOPPER NOT TESTED: the worker makes cgroups, and the test hides them, as root (CI)")
    after = "sleep 0.3" if ending == "left-behind" else "exec sleep 60"
    script = f'"$0" -c "$1" "$2" & {after}'
    stop = tmp_path / "project" / "stop-hopping"
    # The interpreter itself, not the venv's link to it: the sandbox empties
    # /tmp, so a venv of a clone under /tmp is not there (the project is).
    python = os.path.realpath(sys.executable)
    job = Job(tmp_path, ["sh", "-c", script, python, hopper, str(stop)], sandbox=sandbox,
              outputs=["out/"], timeout=1.0 if ending == "timed-out" else None)  # fmt: skip
    prefix = [] if cgroup else NO_CGROUP
    proc = subprocess.Popen([*prefix, sys.executable, str(WORKER), str(job.path)], stdin=subprocess.DEVNULL)
    try:
        if ending == "cancelled":
            wait_for(lambda: job.started() and beats(job) > 0, "the hopper to start")
            proc.send_signal(signal.SIGTERM)
        assert finish(proc) == 0
        expected = {"left-behind": "succeeded", "cancelled": "cancelled", "timed-out": "timed_out"}[ending]
        assert job.status()["state"] == expected, job.log()
        assert beats(job) > 0  # it did run
        # A surviving hopper is a live process naming the stop file at every
        # moment (each one forks the next before it exits), until the file
        # is made: none may be left once the worker is gone.
        wait_for(lambda: not marked_pids(str(stop)), "every hopper to be gone with its run")
        # under bubblewrap the pid namespace holds the tree: no cgroup is made
        assert (job.status()["cgroup"] is not None) is (cgroup and sandbox == "none"), job.status()
    finally:
        # Failed before the worker ended (the hopper never started, say):
        # stopped and waited for by its pid here, not left running to a
        # ResourceWarning in whichever later test collects its Popen.
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT)
        stop.touch()  # a survivor ends itself

        def held_still() -> bool:
            before = beats(job)
            time.sleep(0.1)
            return beats(job) == before

        wait_for(held_still, "a surviving hopper to stop")


@pytest.mark.parametrize("ending", ["left-behind", "cancelled", "timed-out"])
@pytest.mark.parametrize("cgroup", [True, False], ids=["cgroup", "no-cgroup"])
@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_a_process_that_keeps_forking_and_exiting_dies_with_the_run(
    tmp_path: Path, sandbox: str, cgroup: bool, ending: str
) -> None:
    run_hopper(tmp_path, sandbox, cgroup, ending)


def test_a_hopper_that_leaves_the_session_each_time_dies_with_its_cgroup(tmp_path: Path) -> None:
    """Out of the command's process group too: only the cgroup holds it."""
    own_session = HOPPER.replace("os._exit(0)", "os._exit(0)\n    os.setsid()")
    run_hopper(tmp_path, "none", True, "left-behind", own_session)


def test_worker_detach_returns_once_the_command_started(
    tmp_path: Path, worker_python: str, marker: str
) -> None:
    job = Job(tmp_path, ["sh", "-c", "while :; do sleep 1; done", marker])
    done = subprocess.run(
        [worker_python, str(WORKER), str(job.path), "--detach"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=WAIT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    status = job.status()
    assert status["state"] == "running"
    assert marked_pids(marker)
    # The detached worker is stopped by the autouse fixture (SIGTERM by pid).


def test_worker_usage_error_exits_2(worker_python: str) -> None:
    done = subprocess.run([worker_python, str(WORKER)], capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "usage: worker.py JOB_JSON" in done.stderr


def test_worker_sandbox_bwrap_without_bubblewrap_fails_the_run(tmp_path: Path, worker_python: str) -> None:
    job = Job(tmp_path, ["/bin/sh", "-c", "echo should-not-run"], sandbox="bwrap")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = subprocess.Popen(
        [worker_python, str(WORKER), str(job.path)], stdin=subprocess.DEVNULL, env={"PATH": str(empty)}
    )
    assert finish(proc) == 1
    status = job.status()
    assert status["state"] == "failed"
    assert "bubblewrap is not installed" in status["message"]
    assert "should-not-run" not in job.log()
