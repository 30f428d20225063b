"""What a preempted run costs, and its `max_cost` over all its attempts,
on the namespace ssh host priced by `hourly_cost` (real sshd, rsync and
`doit`): the host restarted mid-run (tests/support/testbeds/sshd_host.py
`reboot`) and the run relaunched (`preemptions=1`); each attempt's machine
counted from its launch until it was found lost or let go."""

from __future__ import annotations

import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest
from checkpoint_parts import count_step, result_of
from dodo_helpers import compute, compute_status, kill_pids, popen_doit, popen_output, show, stop, wait_for
from local_runs import kill_pid, marked_pids
from preemption_parts import PAUSE, counting_project, doit_through_a_restart, sshd_sessions
from progress import wait_exit
from ssh_helpers import make_ssh_project, needs_root, needs_sshd, one_step, only_handle
from testbeds.sshd_host import SshHost, kill_sshd, reboot

pytestmark = [needs_sshd, needs_root]

# A cent a second: a cap of a few tenths is reached in seconds.
CENT_A_SECOND = 36.0


def epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_a_relaunched_run_costs_the_machine_time_of_both_attempts(tmp_path: Path, host: SshHost) -> None:
    root = counting_project(tmp_path, host, count_step("count", 6, PAUSE, preemptions=1),
                            hourly_cost=CENT_A_SECOND)  # fmt: skip
    code, said = doit_through_a_restart(root, host, "count", 3)
    assert code == 0, said
    assert "relaunching it, attempt 2 of at most 2" in said, said
    assert result_of(root, "count")[0] == 6
    # Before the launch, the worst case says the timeout-less run's lifetime counts per attempt.
    assert "for each of up to 2 attempts" in said, said

    [run] = compute_status(root)
    one, two = run["attempts"]
    assert (one["outcome"], two["outcome"]) == ("lost", "succeeded"), run["attempts"]
    # The run's machine time and cost are its two attempts' together, each at the hourly_cost.
    assert one["machine_seconds"] > 3.0 and two["machine_seconds"] > 3.0, run["attempts"]  # 3 counts at least
    assert run["machine_seconds"] == pytest.approx(one["machine_seconds"] + two["machine_seconds"])
    assert run["cost_usd"] == pytest.approx(one["cost_usd"] + two["cost_usd"])
    assert one["hourly_cost"] == two["hourly_cost"] == CENT_A_SECOND
    assert one["cost_usd"] == pytest.approx(one["machine_seconds"] * 0.01)
    # The lost machine is counted until it was found lost (when attempt 2 was launched), not to the end.
    lost_until = epoch(two["launched_at"])
    handle = only_handle(root, "count")
    (earlier,) = handle["state"]["machine"]["earlier"]
    assert earlier["released_at"] == pytest.approx(lost_until, abs=1.0), (earlier, two)
    assert handle["state"]["cost_usd"] == pytest.approx(run["cost_usd"])  # kept as the last machine went

    # `status RUN` lists each attempt with its own cost, and the run's total.
    shown = compute(root, "status", run["run_id"])
    assert shown.returncode == 0, show(shown)
    assert f"attempt 1 on {host.address}" in shown.stdout, shown.stdout
    assert f"cost {'$'}{one['cost_usd']:.4f}" in shown.stdout, shown.stdout
    assert f"cost {'$'}{two['cost_usd']:.4f}" in shown.stdout, shown.stdout
    assert f"${run['cost_usd']:.4f}" in shown.stdout.splitlines()[1], shown.stdout


def test_a_relaunch_gets_only_the_budget_left_and_is_stopped_at_its_cap(
    tmp_path: Path, host: SshHost
) -> None:
    # $0.40 at a cent a second: 40 s over all attempts, far less than the 120 counts need.
    root = counting_project(tmp_path, host, count_step("count", 120, PAUSE, preemptions=1, max_cost=0.4),
                            hourly_cost=CENT_A_SECOND)  # fmt: skip
    code, said = doit_through_a_restart(root, host, "count", 3)
    assert code == 1, said
    assert "relaunching it, attempt 2 of at most 2" in said, said
    assert "its cost reached max_cost = $0.4000" in said, said
    assert "Traceback" not in said, said
    [run] = compute_status(root)
    one, two = run["attempts"]
    assert (one["outcome"], two["outcome"]) == ("lost", "timed_out"), run["attempts"]
    # Its verdict, recorded by the client that followed it: failed at its cap
    assert run["state"] == "failed" and "max_cost = $0.4000" in run["message"], run
    # The second attempt ran on what the first left: together they come to the cap, not a cap each.
    assert one["cost_usd"] > 0.03, one  # three counts and the launch at least
    assert 0.4 <= run["cost_usd"] < 0.4 + 0.3, run
    assert two["cost_usd"] < 0.4 - one["cost_usd"] + 0.3, (one, two)


def test_a_lost_run_whose_cap_is_spent_is_not_relaunched(tmp_path: Path, host: SshHost) -> None:
    marker = f"spent-{uuid.uuid4().hex[:8]}"
    # $0.40 at a cent a second: spent forty seconds after the launch, long
    # after the run is going even on a loaded machine (with ten, the host's
    # worker could stop the command at its cap before the test took the host
    # away, and the client saw it end there: not what this test is about).
    body = one_step(command=["/bin/sh", "-c", "echo started; sleep 600", marker], outputs=["out.txt"],
                    max_cost=0.4, preemptions=1)  # fmt: skip
    root = make_ssh_project(tmp_path, host, body, sandbox="none", hourly_cost=CENT_A_SECOND,
                            remote_root=str(host.scratch / f"remote-{tmp_path.name}"))  # fmt: skip
    proc = popen_doit(root)
    try:
        wait_for(lambda: marked_pids(marker), "the run to be going", timeout=120)
        # The host out of reach (sshd down, the run going on there): the client waits for it...
        kill_sshd(host)
        kill_pids(sshd_sessions(host))  # any the tree walk missed
        wait_for(lambda: "does not answer" in popen_output(root), "the client to see the host gone", 120)
        # ... past the cap, then the host restarts: the run is found lost with its budget spent.
        asked = only_handle(root)["state"]["machine"]["asked_at"]
        wait_for(lambda: time.time() > asked + 41.0, "the cap's forty seconds to pass", 90)
        reboot(host)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
        for pid in marked_pids(marker):  # only if a failure above left it
            kill_pid(pid)
    said = popen_output(root)
    assert code == 1, said
    assert "its machine was lost while the command ran; its max_cost = $0.4000 is spent" in said, said
    assert "over its 1 attempt(s)" in said and "raise max_cost" in said, said
    assert "relaunching" not in said and "Traceback" not in said, said
    [run] = compute_status(root)
    (attempt,) = run["attempts"]
    assert attempt["outcome"] == "lost", attempt
    assert run["cost_usd"] >= 0.4, run
