"""The local backend end to end: detached workers whose whole task tree stops.

Each stop test checks by pid, through the marker in every process's argv,
that nothing of the tree is left; with and without bubblewrap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from dodo_helpers import (
    compute,
    doit,
    doit_ok,
    make_project,
    pid_alive,
    popen_doit,
    run_dirs,
    show,
    step_ran,
    stop,
    unsafe_modes,
)
from local_backend_parts import path_without_bwrap  # noqa: F401 - fixtures
from local_runs import (
    SANDBOXES,
    cli,
    describe,
    kill_pid,
    log_text,
    marked_pids,
    outputs_root,
    read_pid_sid,
    ready_files,
    run_dir,
    status_record,
    stubborn_tree,
    submit,
    wait_final,
    wait_for,
)
from lost_tree import kill_recorded, kill_worker, overlap, status_of, step_argv, wait_tree_up, write_command

from substrax_tasks._remote import control
from substrax_tasks.backends.local import backend as local_backend
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project


def start_stubborn(
    project: Project, marker: str, sandbox: str, descendant: str, timeout: float | None = None
) -> tuple[RunHandle, Path, Path]:
    """Submit a task that ignores SIGTERM and whose descendant does too;
    return once both have set their traps."""
    handle = submit(
        project, stubborn_tree(marker, descendant), sandbox=sandbox, outputs=["out/"], timeout=timeout
    )
    task_ready, descendant_ready = ready_files(outputs_root(project, handle), descendant)
    wait_for(lambda: task_ready.exists() and descendant_ready.exists(), "the task and its descendant")
    assert len(marked_pids(marker)) >= 2, describe(marked_pids(marker))
    return handle, task_ready, descendant_ready


def assert_tree_gone(marker: str) -> None:
    left = marked_pids(marker)
    assert not left, f"still alive:\n{describe(left)}"


# ------------------------------------------------------------------ running


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_local_run_succeeds_with_log_env_and_outputs(project: Project, sandbox: str) -> None:
    script = 'echo "to stdout"; echo "to stderr" >&2; echo "$GREETING from $(pwd)"; echo 42 > out/answer.txt'
    handle = submit(
        project, ["sh", "-c", script], sandbox=sandbox, outputs=["out/"], env={"GREETING": "hello"}
    )
    assert wait_final(project, handle) == "succeeded"
    record = status_record(project, handle)
    assert record["exit_code"] == 0
    assert record["sandbox"] == sandbox
    assert record["started_at"] and record["ended_at"]
    log = log_text(project, handle)
    assert "to stdout" in log
    assert "to stderr" in log
    assert f"hello from {project.root}" in log
    assert "left running" not in log  # a clean run leaves nothing behind to kill
    root = outputs_root(project, handle)
    assert (root / "out" / "answer.txt").read_text() == "42\n"
    # the end-of-run manifest the fetch verifies against
    assert (run_dir(project, handle) / "manifest.json").is_file()
    if sandbox == "bwrap":
        # The output landed in the run's staging folder, not in the project.
        assert root == run_dir(project, handle) / "work" / "outputs"
        assert not (project.root / "out" / "answer.txt").exists()
    else:
        assert root == project.root


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_local_run_failure_records_exit_code(project: Project, sandbox: str) -> None:
    handle = submit(project, ["sh", "-c", "exit 3"], sandbox=sandbox)
    assert wait_final(project, handle) == "failed"
    status = project.backend_for(handle).poll(handle)
    assert status.exit_code == 3


def test_local_run_is_detached_from_the_client(project: Project, marker: str) -> None:
    handle = submit(project, ["sh", "-c", "while :; do sleep 1; done", marker])
    record = status_record(project, handle)
    worker = record["worker_pid"]
    # The worker leads its own session and is not a child of this process:
    # the client may exit, the run goes on.
    assert os.getsid(worker) == worker
    assert os.getsid(worker) != os.getsid(0)
    with pytest.raises(ChildProcessError):
        os.waitpid(worker, os.WNOHANG)
    # ... and so does the task: its own session, not the worker's.
    assert os.getsid(record["pid"]) == record["pid"]
    assert project.backend_for(handle).cancel(handle)


def test_pause_wakes_when_the_worker_exits(project: Project, marker: str) -> None:
    """A wait on a local run wakes as its worker exits, not at a later poll:
    pause() times out while the worker lives, and says the run may have
    ended as soon as it has (here a minute would be a hang, not a wait)."""
    handle = submit(project, ["sh", "-c", "while :; do sleep 1; done", marker])
    backend = project.backend_for(handle)
    assert backend.pause(handle, 0.01) is False
    assert backend.cancel(handle)
    assert backend.pause(handle, 60.0) is True
    assert backend.wait(handle).state == "cancelled"


def test_the_worker_outlives_the_spawner_that_started_it(project: Project, marker: str) -> None:
    """Workers are forked by one spawner per client process (no interpreter
    per run), yet each leaves it: when the spawner ends with its client, the
    run goes on."""
    handle = submit(project, ["sh", "-c", "while :; do sleep 1; done", marker])
    worker = status_record(project, handle)["worker_pid"]
    spawner = local_backend._SPAWNER._proc
    assert spawner is not None
    with pytest.raises(ChildProcessError):  # not the spawner's child either: reparented
        os.waitpid(worker, os.WNOHANG)
    local_backend._SPAWNER.close()
    assert spawner.returncode is not None
    backend = project.backend_for(handle)
    assert backend.poll(handle).state == "running"
    assert backend.cancel(handle)


def test_a_dead_spawner_is_replaced_and_each_run_gets_its_own_environment(
    project: Project, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spawner outlives one run, not the environment: each worker gets
    the client's environment as it is when that run starts (its secrets
    included), and a spawner that died is replaced by the next start."""
    first = submit(project, ["true"])
    assert wait_final(project, first) == "succeeded"
    spawner = local_backend._SPAWNER._proc
    assert spawner is not None
    kill_pid(spawner.pid)
    spawner.wait()
    monkeypatch.setenv("SUBSTRAX_TEST_SECRET", "later value")
    spec = make_spec(
        "secret", ["sh", "-c", 'echo "secret: $SUBSTRAX_TEST_SECRET"'], project.root,
        forward_env=["SUBSTRAX_TEST_SECRET"],
    )
    handle = project.submit(spec, settings={"sandbox": "none"})
    assert wait_final(project, handle) == "succeeded"
    assert "secret: later value" in log_text(project, handle)
    assert local_backend._SPAWNER._proc is not spawner


# ------------------------------------------------------------------ stopping


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_local_cancel_stops_task_and_descendant(project: Project, marker: str, sandbox: str) -> None:
    handle, _, _ = start_stubborn(project, marker, sandbox, "child")
    done = cli(project.root, "cancel", handle.run_id)
    assert done.returncode == 0, done.stderr
    assert "cancelled" in done.stdout
    # The final status is written only once the whole tree is gone.
    assert status_record(project, handle)["state"] == "cancelled"
    assert_tree_gone(marker)
    assert "stopping the task tree (SIGTERM)" in log_text(project, handle)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_local_cancel_stops_setsid_grandchild(project: Project, marker: str, sandbox: str) -> None:
    handle, task_ready, grandchild_ready = start_stubborn(project, marker, sandbox, "grandchild")
    _, task_sid = read_pid_sid(task_ready)
    grandchild_pid, grandchild_sid = read_pid_sid(grandchild_ready)
    # The grandchild really escaped: a session of its own.
    assert grandchild_sid == grandchild_pid
    assert grandchild_sid != task_sid
    done = cli(project.root, "cancel", handle.run_id)
    assert done.returncode == 0, done.stderr
    assert project.backend_for(handle).poll(handle).state == "cancelled"
    assert_tree_gone(marker)


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_local_timeout_kills_tree_and_records_timed_out(project: Project, marker: str, sandbox: str) -> None:
    handle, _, _ = start_stubborn(project, marker, sandbox, "grandchild", timeout=1.0)
    assert wait_final(project, handle) == "timed_out"
    assert_tree_gone(marker)
    record = status_record(project, handle)
    assert record["ended_at"]
    assert "timeout of 1.0s" in log_text(project, handle)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_signal_to_worker_finishes_cleanup_before_it_exits(
    project: Project, marker: str, sandbox: str, sig: signal.Signals
) -> None:
    handle, _, _ = start_stubborn(project, marker, sandbox, "grandchild")
    record = status_record(project, handle)
    worker, ticks = record["worker_pid"], record["worker_start_ticks"]
    os.kill(worker, sig)
    wait_for(lambda: not control.alive(worker, ticks), f"the worker to exit after {sig.name}")
    # Gone only after the tree was stopped and the final status written.
    record = status_record(project, handle)
    assert record["state"] == "cancelled"
    assert record["ended_at"]
    assert_tree_gone(marker)
    assert f"stopping the task tree ({sig.name})" in log_text(project, handle)


def test_cancel_after_the_worker_was_killed(project: Project, marker: str) -> None:
    """A worker killed by SIGKILL cannot clean up: the run reads as lost and
    cancel kills the task's process group itself."""
    handle, _, _ = start_stubborn(project, marker, "none", "child")
    record = status_record(project, handle)
    worker = record["worker_pid"]
    kill_pid(worker, signal.SIGKILL)
    backend = project.backend_for(handle)
    wait_for(lambda: backend.poll(handle).state == "lost", "the run to read as lost")
    assert "worker" in (backend.poll(handle).message or "")
    assert backend.cancel(handle)
    assert backend.poll(handle).state == "cancelled"
    wait_for(lambda: not marked_pids(marker), "the task's group to die")


def test_teardown_cancels_a_running_run_first(project: Project, marker: str) -> None:
    handle, _, _ = start_stubborn(project, marker, "none", "child")
    backend = project.backend_for(handle)
    backend.teardown(handle)
    assert backend.poll(handle).state == "cancelled"
    assert_tree_gone(marker)
    assert not (run_dir(project, handle) / "work").exists()
    backend.teardown(handle)  # idempotent


# ------------------------------------------------- without bubblewrap at hand


@pytest.mark.usefixtures("path_without_bwrap")
def test_sandbox_auto_without_bubblewrap_runs_and_says_so(project: Project) -> None:
    handle = submit(project, ["/bin/sh", "-c", "echo ran > out/x"], sandbox="auto", outputs=["out/"])
    assert wait_final(project, handle) == "succeeded"
    assert status_record(project, handle)["sandbox"] == "none"
    assert "running WITHOUT a sandbox" in log_text(project, handle)
    assert (project.root / "out" / "x").read_text() == "ran\n"


# ------------------------------------------------- outputs carry no privileges

# A command (root in the sandbox, with no capabilities, may still do this to
# its own files) that leaves setuid, setgid, sticky and world-writable bits
# on files and folders of its outputs, one declared as a file on its own.
PRIVILEGED_OUTPUTS = """
def task_make():
    yield from remote_step(
        "make",
        shell="mkdir -p out/d && echo a > out/suid && echo b > out/d/open && echo c > alone "
              "&& ln -s suid out/link && chmod 6755 out/suid && chmod 4777 out/d/open && chmod 2755 alone "
              "&& chmod 1777 out/d && chmod o+w out",
        outputs=["out/", "alone"],
    )
"""


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_outputs_promoted_keep_no_setuid_sticky_or_world_writable_bit_and_stay_up_to_date(
    tmp_path: Path, sandbox: str
) -> None:
    """Under bubblewrap the outputs are promoted from the sandbox's staging
    folder; without a sandbox they were written in place: either way the
    promotion clears the bits, the verified manifest says so, and the next
    `doit` is a no-op (no endless rerun for a mode it changed itself)."""
    root = make_project(tmp_path, PRIVILEGED_OUTPUTS, ["make"], sandbox=sandbox)
    done = doit_ok(root)
    assert step_ran(done, "make"), show(done)
    assert unsafe_modes(root, ["out", "alone"]) == {}, show(done)
    assert (root / "out" / "suid").stat().st_mode & 0o7777 == 0o755
    assert (root / "out" / "d" / "open").stat().st_mode & 0o7777 == 0o775
    assert (root / "alone").stat().st_mode & 0o7777 == 0o755
    assert (root / "out" / "d").stat().st_mode & 0o7777 == 0o775
    assert (root / "out" / "link").is_symlink() and (root / "out" / "suid").read_text() == "a\n"
    again = doit_ok(root)
    assert not step_ran(again, "make"), show(again)
    assert "up to date" in compute(root, "why", "make").stdout


def test_clearing_the_bits_never_goes_through_a_symlink_to_a_file_outside(tmp_path: Path) -> None:
    """Written in place (no sandbox), an output may be a link out of the
    project, or lie under one: the promotion refuses that tree, and clears
    no bit of what the link points at on its way."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "tool").write_text("#!/bin/sh\n")
    (outside / "tool").chmod(0o4755)
    body = f"""
def task_make():
    yield from remote_step("make", outputs=["out/", "sub/tool"],
                           shell="mkdir -p out && ln -s {outside}/tool out/escape && ln -sfn {outside} sub")
"""
    root = make_project(tmp_path, body, ["make"], sandbox="none")
    done = doit(root)
    assert done.returncode != 0 and "refused, never followed" in done.stdout + done.stderr, show(done)
    assert (outside / "tool").stat().st_mode & 0o7777 == 0o4755

# ------------------------------------- a worker killed without ending its run

LOST_STEP = """
def task_work():
    yield from remote_step("work", command={argv!r}, outputs=["out/result.txt"])
"""


@pytest.mark.parametrize("cgroup", ["cgroup", "no-cgroup"])
def test_a_tree_left_by_a_killed_worker_is_stopped_by_the_next_doit_before_its_new_command(
    tmp_path: Path, marker: str, cgroup: str
) -> None:
    """Without bubblewrap, the worker killed by SIGKILL (the doit first):
    the command, a grandchild that double-forked into a session of its own
    and a child with no environment go on. The next doit finds them (by the
    cgroup the worker made; without one, by the mark the tree carries and
    the command's session) and stops them before the new command starts;
    no cgroup of the run is left."""
    flags = tmp_path / "flags"
    write_command(flags)
    root = make_project(tmp_path, LOST_STEP.format(argv=step_argv(flags, marker, "out/result.txt")),
                        ["work"], sandbox="none")  # fmt: skip
    first = popen_doit(root)
    try:
        old = wait_tree_up(flags)
        (run,) = run_dirs(root)
        stop(first)  # the client goes first, as the OOM killer may take it too
        record = status_of(root, run)
        kill_worker(record)
        made = record.get("cgroup")
        if cgroup == "no-cgroup":  # as a host without cgroup v2 (or no right to one) records it
            record["cgroup"] = None
            (run / "status.json").write_text(json.dumps(record))
        elif made is None:
            pytest.skip("NO CGROUP V2 COULD BE MADE HERE: the cgroup case is not tested")
        assert all(pid_alive(pid) for pid in old)  # the tree outlived its worker
        again = doit(root, timeout=120)
        assert again.returncode == 0, show(again)
        assert overlap(flags) == [], "the new command started while these of the old tree ran"
        assert not [pid for pid in old if pid_alive(pid)]
        assert "was lost" in again.stdout and "stopped what was left of it" in again.stdout, show(again)
        assert (root / "out" / "result.txt").read_text() == "done\n"
        if isinstance(made, str):
            assert not Path(made).exists(), f"the run's cgroup {made} was left"
    finally:
        stop(first)
        kill_recorded(flags, marker)


def test_the_lifetime_timer_stops_what_a_killed_worker_left_and_removes_its_cgroup(
    tmp_path: Path, project: Project, marker: str
) -> None:
    """The watchdog a host runs (control.py watchdog) ends a run whose
    worker was killed: its tree, setsid grandchild included, and its cgroup
    go with its folder."""
    flags = tmp_path / "flags"
    write_command(flags)
    handle = submit(project, step_argv(flags, marker, "out/result.txt"), sandbox="none")
    try:
        old = wait_tree_up(flags)
        record = status_record(project, handle)
        kill_worker(record)
        assert all(pid_alive(pid) for pid in old)
        fired = control.watchdog(str(run_dir(project, handle)), 0)
        assert fired == {"fired": True}
        assert not [pid for pid in old if pid_alive(pid)]
        assert not run_dir(project, handle).exists()
        if isinstance(record.get("cgroup"), str):
            assert not Path(record["cgroup"]).exists()
    finally:
        kill_recorded(flags, marker)


def test_a_process_with_a_runs_mark_that_is_older_than_its_worker_is_never_taken_for_the_runs(
    marker: str,
) -> None:
    """The mark alone proves nothing about a process started before the
    run's worker (its pid may have been reused): it is neither found nor
    signalled; started no earlier than the worker, it is the run's."""
    mark = uuid.uuid4().hex
    env = {**os.environ, control.RUN_MARK: mark}
    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker], env=env)
    try:
        wait_for(lambda: control.start_ticks(older.pid) is not None, "the process to start")
        ticks = control.start_ticks(older.pid)
        assert ticks is not None
        later_worker = {"state": "running", "mark": mark, "worker_start_ticks": ticks + 1}
        assert control.leftovers(later_worker) == []
        assert control.stop_leftovers(later_worker, 1.0) == []
        assert older.poll() is None
        assert control.leftovers({**later_worker, "worker_start_ticks": ticks}) == [older.pid]
    finally:
        older.kill()
        older.wait(timeout=30)
