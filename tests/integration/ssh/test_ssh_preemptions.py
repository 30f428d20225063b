"""A host lost while a step's command runs (`remote_step(...,
preemptions=N)`), against a real sshd in a network namespace
(tests/support/testbeds/sshd_host.py), real rsync and bubblewrap there: the
host restarted mid-run (its network down, every process of it SIGKILLed by
pid, its scratch disk emptied, sshd back) relaunches the run in a fresh
folder, its command starting from the last snapshot brought home; with no
preemption allowed the step fails saying how to allow one; a host that
only stops answering for a while (sshd down, the worker alive) is waited
for and the run followed again, never relaunched, as one whose network is
cut for a while; without a sandbox, what a killed worker's command left on
the host is stopped before the relaunch starts its command."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from checkpoint_parts import count_step, counts, kept_state, result_of, starts
from dodo_helpers import compute, doit, kill_pids, pid_alive, popen_doit, popen_output, show, stop, wait_for
from lost_tree import (
    frozen,
    kill_recorded,
    kill_worker,
    overlap,
    recorded_pids,
    step_argv,
    wait_tree_up,
    write_command,
)
from preemption_parts import (
    PAUSE,
    attempts_of,
    counted,
    counting_project,
    doit_through_a_restart,
    sshd_sessions,
)
from progress import wait_exit
from ssh_helpers import (
    live_handles,
    make_ssh_project,
    needs_root,
    needs_sshd,
    one_step,
    only_handle,
    remote_run_dir,
    remote_status,
    ssh_settings,
)
from testbeds.sshd_host import SshHost, kill_sshd, reboot, restart_sshd

pytestmark = [needs_sshd, needs_root]


def test_a_host_restarted_mid_run_relaunches_it_from_the_last_snapshot(tmp_path: Path, host: SshHost) -> None:
    root = counting_project(tmp_path, host, count_step("count", 8, PAUSE, preemptions=1))
    proc = popen_doit(root, "count")
    try:
        counted(root, "count", 3)
        first_folder = remote_run_dir(live_handles(root, "count")[0])
        reboot(host)
        wait_for(lambda: "starts from the checkpoints" in popen_output(root), "attempt 2 to start", 120)
        # The new attempt's folder is the run's, not a leak `gc --machines` would remove
        machines = compute(root, "status", "--machines")
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 0, said
    assert machines.returncode == 0 and "leaked" not in machines.stderr, show(machines)
    assert "may still hold a machine" in machines.stderr, show(machines)
    run_id = only_handle(root, "count")["run_id"]
    assert f"count: run {run_id}: attempt 1 lost its machine ({host.address}:" in said, said
    assert "relaunching it, attempt 2 of at most 2" in said, said
    started = rf"attempt 2 on {re.escape(host.address)} starts from the checkpoints it last kept \(snap-"
    assert re.search(started, said), said
    assert "Traceback" not in said, said
    assert result_of(root, "count") == (8, list(range(1, 9)))
    one, two = attempts_of(root, "count")
    assert (one["outcome"], two["outcome"]) == ("lost", "succeeded"), (one, two)
    assert one["machine"] == two["machine"] == host.address
    assert one["snapshot"] is None and str(two["snapshot"]).startswith("snap-"), (one, two)
    # The counts redone: those the lost attempt printed past the snapshot
    # the second started from: at most the one a snapshot lags behind and
    # the one under way as the host went.
    resumed = starts(said)[-1]
    before = said[: said.index(f"start {resumed}")]
    last_seen = max(int(c) for c in re.findall(r"^count (\d+)$", before, re.M))
    assert resumed >= 3 and last_seen - resumed <= 2, (resumed, last_seen)
    # A fresh folder for the new attempt; the lost one's went with the restart, and this one once promoted.
    second_folder = remote_run_dir(only_handle(root, "count"))
    assert second_folder.name == f"{run_id}-attempt2" and second_folder != first_folder
    assert not first_folder.exists() and not second_folder.exists()


def test_a_host_restarted_with_no_preemption_allowed_fails_saying_how_to_allow_one(
    tmp_path: Path, host: SshHost
) -> None:
    root = counting_project(tmp_path, host, count_step("count", 30, PAUSE))
    code, said = doit_through_a_restart(root, host, "count", 2)
    assert code == 1, said
    how = "its machine was lost while the command ran; remote_step('count', ..., preemptions=1) relaunches it"
    assert how in said, said
    assert "relaunching" not in said and "Traceback" not in said, said
    (attempt,) = attempts_of(root, "count")
    assert attempt["outcome"] == "lost", attempt


def test_a_host_that_stops_answering_for_a_while_is_waited_for_not_relaunched(
    tmp_path: Path, host: SshHost
) -> None:
    root = counting_project(tmp_path, host, count_step("count", 10, PAUSE, preemptions=1))
    proc = popen_doit(root, "count")
    try:
        counted(root, "count", 2)
        kill_sshd(host)  # the listener and every session: the worker, detached, goes on
        kill_pids(sshd_sessions(host))  # any the tree walk missed (seen once on a loaded machine)
        try:
            wait_for(lambda: "does not answer" in popen_output(root), "the client to see the host gone", 120)
            # Counts go on while no one can reach the host.
            at = (kept_state(root, "count") or {})["i"]
            status = remote_run_dir(only_handle(root, "count")) / "status.json"
            assert '"running"' in status.read_text()
        finally:
            restart_sshd(host)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 0, said
    assert "waiting up to 600 s for it to answer again" in said, said
    assert "its machine answers again; following the run" in said, said
    assert "relaunching" not in said and "Traceback" not in said, said
    assert starts(said) == [0], said  # one command, never started again
    assert at >= 2
    assert result_of(root, "count") == (10, list(range(1, 11)))
    (attempt,) = attempts_of(root, "count")
    assert attempt["outcome"] == "succeeded", attempt


def test_a_step_without_checkpoints_is_relaunched_from_nothing(tmp_path: Path, host: SshHost) -> None:
    """No snapshot pull talks to the host while it is followed: the lost
    connection is seen all the same, and the command starts again afresh."""
    body = one_step("slow", shell="echo begun; sleep 3; echo made > out.txt", outputs=["out.txt"],
                    preemptions=1)  # fmt: skip
    remote_root = str(host.scratch / f"remote-{tmp_path.name}")
    root = make_ssh_project(tmp_path, host, body, ["slow"], remote_root=remote_root)
    proc = popen_doit(root, "slow")
    try:
        wait_for(lambda: "begun" in popen_output(root), "the command to start", 120)
        reboot(host)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 0, said
    assert "attempt 2 on" in said and "starts with no checkpoints kept" in said, said
    assert said.count("begun") == 2, said
    assert (root / "out.txt").read_text() == "made\n"
    one, two = attempts_of(root, "slow")
    assert (one["outcome"], two["outcome"]) == ("lost", "succeeded"), (one, two)
    assert one["snapshot"] is None and two["snapshot"] is None


LOST_STEP = """
def task_work():
    yield from remote_step("work", command={argv!r}, inputs=["data.txt"], outputs=["out/result.txt"],
                           preemptions=1)
"""


def test_without_a_sandbox_a_killed_workers_tree_on_the_host_is_stopped_before_the_relaunch_starts(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    """sandbox = "none" on the host: its worker killed by SIGKILL (by the
    pid its status.json gives) while doit follows the run; the command, a
    setsid grandchild and a child with no environment go on. The relaunch
    stops them (found by the run's mark and the command's session: the
    host's user may make no cgroup) and removes the lost attempt's folder
    before attempt 2's command starts in a fresh one, which gets the step's
    view only, as the first did; the command records any process of
    attempt 1 it finds alive as it starts: none."""
    flags = host.scratch / f"flags-{marker}"  # the command writes here, as the host's user
    write_command(flags)
    os.chown(flags, host.uid, -1)
    argv = step_argv(flags, marker, "out/result.txt", python=host.python)
    remote_root = host.scratch / f"remote-{tmp_path.name}"
    root = make_ssh_project(tmp_path, host, LOST_STEP.format(argv=argv), ["work"], sandbox="none",
                            remote_root=str(remote_root),
                            files={"data.txt": "one\n", "notes.txt": "not declared\n"})  # fmt: skip
    proc = popen_doit(root)
    try:
        old = wait_tree_up(flags)
        first_folder = remote_run_dir(only_handle(root))
        record = remote_status(only_handle(root))
        assert record is not None
        kill_worker(record)
        code = wait_exit(proc, "the doit to end", 180)
        overlap_seen = overlap(flags)
    finally:
        stop(proc)
        kill_recorded(flags, marker)
        shutil.rmtree(flags, ignore_errors=True)
        shutil.rmtree(remote_root, ignore_errors=True)
    said = popen_output(root)
    assert code == 0, said
    assert "attempt 1 lost its machine" in said and "relaunching it, attempt 2 of at most 2" in said, said
    assert overlap_seen == [], "attempt 2 started while these of attempt 1's tree ran"
    assert not [pid for pid in old if pid_alive(pid)], old
    assert (root / "out" / "result.txt").read_text() == "done\n"
    assert [a["outcome"] for a in attempts_of(root, "work")] == ["lost", "succeeded"]
    assert not first_folder.exists(), "the lost attempt's folder stayed on the host"
    # Each attempt's fresh folder got the step's view only: data.txt, not notes.txt nor the dodo.
    assert re.findall(r"^upload: (\d+) files, ", said, re.M) == ["1", "1"], said


def test_a_host_cut_off_the_network_for_a_while_is_followed_on_never_relaunched(
    tmp_path: Path, host: SshHost
) -> None:
    """The host's network cut (its namespace's link down, sshd and the
    worker left alone) while three counts are made there, then back: the
    run goes on there and the same doit follows it to its end. One attempt,
    one command: never a second copy started beside it."""
    assert host.netns is not None, "the host fixture runs sshd in a network namespace"
    root = counting_project(tmp_path, host, count_step("count", 10, PAUSE, preemptions=1))
    link = ["ip", "-n", host.netns, "link", "set", "eth0"]
    proc = popen_doit(root, "count")
    try:
        counted(root, "count", 2)
        log = remote_run_dir(only_handle(root, "count")) / "run.log"
        subprocess.run([*link, "down"], check=True, timeout=30)
        try:
            at = counts(log.read_text())[-1]
            wait_for(lambda: counts(log.read_text())[-1] >= at + 3, "three counts made while cut off", 60)
        finally:
            subprocess.run([*link, "up"], check=True, timeout=30)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 0, said
    assert "relaunching" not in said and "Traceback" not in said, said
    assert starts(said) == [0], said
    assert result_of(root, "count") == (10, list(range(1, 11)))
    (attempt,) = attempts_of(root, "count")
    assert attempt["outcome"] == "succeeded", attempt


def test_a_lost_attempts_process_that_will_not_stop_keeps_the_relaunch_from_starting_beside_it(
    tmp_path: Path, host: SshHost, marker: str
) -> None:
    """sandbox = "none", the worker killed: one process of the command's
    tree cannot be stopped (frozen: a SIGKILL waits until it thaws). The
    relaunch does not start attempt 2 beside it: the step fails naming the
    process and what to do. Once it is gone, the next doit stops what is
    left and runs the step anew."""
    flags = host.scratch / f"flags-{marker}"
    write_command(flags)
    os.chown(flags, host.uid, -1)
    argv = step_argv(flags, marker, "out/result.txt", python=host.python)
    remote_root = host.scratch / f"remote-{tmp_path.name}"
    root = make_ssh_project(tmp_path, host, LOST_STEP.format(argv=argv), ["work"], sandbox="none",
                            remote_root=str(remote_root), files={"data.txt": "one\n"})  # fmt: skip
    proc = popen_doit(root)
    try:
        old = wait_tree_up(flags)
        stuck = old[1]
        with frozen(stuck, f"substrax-test-{marker}"):
            record = remote_status(only_handle(root))
            assert record is not None
            kill_worker(record)
            code = wait_exit(proc, "the doit to end", 180)
            started = recorded_pids(flags)
            seen = overlap(flags)
        wait_for(lambda: not pid_alive(stuck), "the thawed process to end by the SIGKILL it was sent")
        said = popen_output(root)
        assert code == 2, said
        assert "what is left of its lost attempt on" in said, said
        assert "no new attempt starts beside it" in said and f"(pid {stuck})" in said, said
        assert "Stop those processes there, then run `doit work` again" in said, said
        assert "Traceback" not in said, said
        assert seen == [] and len(started) == 3, "attempt 2 started beside the lost attempt's process"
        again = doit(root, timeout=120)
        assert again.returncode == 0, show(again)
        assert "was lost" in again.stdout and "stopped what was left of it" in again.stdout, show(again)
        assert overlap(flags) == [], "the new run started beside the lost one's tree"
        assert (root / "out" / "result.txt").read_text() == "done\n"
    finally:
        stop(proc)
        kill_recorded(flags, marker)
        shutil.rmtree(flags, ignore_errors=True)
        shutil.rmtree(remote_root, ignore_errors=True)


def test_a_scripts_folder_gone_with_a_restart_is_a_lost_run_never_a_damaged_host(
    tmp_path: Path, host: SshHost
) -> None:
    """A host that restarted with an empty scratch disk has no scripts
    folder: whichever read meets that first (a checkpoint pull, a follower,
    a status read) must not call the host tampered with and fail the run
    (seen in a full run: a pull listed every script as changed, the run
    failed instead of being relaunched). The status says the run's folder
    is gone (a lost run); a folder there with a changed script is still a
    damaged host."""
    from substrax_tasks.backends.remote_run import DamagedHost, RemoteRun, scripts_digest
    from substrax_tasks.backends.ssh.connection import SshConnection
    from substrax_tasks.backends.ssh.settings import SshSettings

    conn = SshConnection(SshSettings.model_validate(ssh_settings(host)).target())
    root = f"{host.scratch}/gone-{tmp_path.name}"
    run = RemoteRun(conn, host.python, f"{root}/bin-{scripts_digest()}", f"{root}/runs/r1")
    try:
        # (raised DamagedHost before: every script read as changed)
        work = f"{run.run_dir}/work"
        listed = run.run_script("checkpoints.py", "list", work, what="listing the checkpoints")
        assert listed.returncode != 0, listed
        assert b"is gone from this host" in listed.stderr, listed
        assert run.status() == {"state": None, "exists": False}

        run.reinstall()
        conn.run(["sh", "-c", 'echo "# changed" >> "$1"', "sh", f"{run.bin_dir}/control.py"])
        with pytest.raises(DamagedHost, match=r"control\.py"):
            run.run_script("checkpoints.py", "list", work, what="listing the checkpoints")
    finally:
        conn.run(["rm", "-rf", root])
        conn.close()
