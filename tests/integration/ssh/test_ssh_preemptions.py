"""A host lost while a step's command runs (`remote_step(...,
preemptions=N)`), against a real sshd in a network namespace
(tests/support/testbeds/sshd_host.py), real rsync and bubblewrap there: the
host restarted mid-run (its network down, every process of it SIGKILLed by
pid, its scratch disk emptied, sshd back) relaunches the run in a fresh
folder, its command starting from the last snapshot brought home; with no
preemption allowed the step fails saying how to allow one; a host that
only stops answering for a while (sshd down, the worker alive) is waited
for and the run followed again, never relaunched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from checkpoint_parts import count_step, kept_state, result_of, starts
from dodo_helpers import compute, kill_pids, popen_doit, popen_output, show, stop, wait_for
from preemption_parts import (
    PAUSE,
    attempts_of,
    counted,
    counting_project,
    doit_through_a_restart,
    sshd_sessions,
)
from ssh_helpers import (
    live_handles,
    make_ssh_project,
    needs_root,
    needs_sshd,
    one_step,
    only_handle,
    remote_run_dir,
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
        code = proc.wait(timeout=300)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 0, said
    assert machines.returncode == 0 and "leaked" not in machines.stderr, show(machines)
    assert "may still hold a machine" in machines.stderr, show(machines)
    run_id = only_handle(root, "count")["run_id"]
    assert f"count: run {run_id}: attempt 1 lost its machine ({host.address}:" in said, said
    assert "relaunching it, attempt 2 of at most 2" in said, said
    started = rf"attempt 2 on {re.escape(host.address)} starts from the checkpoints of snapshot snap-"
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
        code = proc.wait(timeout=300)
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
        code = proc.wait(timeout=300)
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
