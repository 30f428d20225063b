"""What a step costs on an ssh host priced by `hourly_cost`, and its
`max_cost` cap kept by the host itself: through the real `doit` and
`substrax-compute`, against a real sshd in a network namespace."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import compute, doit, show, wait_for
from local_runs import kill_pid, marked_pids
from ssh_helpers import (
    doit_killed_mid_run,
    make_ssh_project,
    needs_root,
    needs_sshd,
    one_step,
    only_handle,
    remote_run_dir,
    remote_status,
)
from testbeds.sshd_host import SshHost

pytestmark = [needs_sshd, needs_root]

# A cent a second: a cap of a few tenths is reached in seconds.
CENT_A_SECOND = 36.0


def status_runs(root: Path) -> list[dict[str, Any]]:
    done = compute(root, "status", "--json")
    assert done.returncode == 0, show(done)
    runs: list[dict[str, Any]] = json.loads(done.stdout)["runs"]
    return runs


def test_a_run_costs_its_machine_time_at_the_hourly_cost(tmp_path: Path, host: SshHost) -> None:
    body = one_step(command=["/bin/sh", "-c", "sleep 1; echo made > out.txt"], outputs=["out.txt"])
    root = make_ssh_project(tmp_path, host, body, hourly_cost=CENT_A_SECOND)
    done = doit(root, timeout=120)
    assert done.returncode == 0, show(done)
    assert "step: $36.0000/h on ssh (hourly_cost)" in done.stdout, show(done)
    [run] = status_runs(root)
    # From the launch to the teardown: more than the command's second, all of it at the price.
    assert run["machine_seconds"] > 1.0, run
    assert run["hourly_cost"] == CENT_A_SECOND
    assert run["cost_usd"] == pytest.approx(run["machine_seconds"] * 0.01)
    handle = only_handle(root)
    assert handle["state"]["cost_usd"] == pytest.approx(run["cost_usd"])  # kept as the machine was let go
    table = compute(root, "status")
    assert table.returncode == 0, show(table)
    header, row = table.stdout.splitlines()[:2]
    assert header.split() == ["run", "step", "backend", "state", "started", "duration", "cost"], table.stdout
    assert row.split()[-1] == f"${run['cost_usd']:.4f}", table.stdout


def test_a_cap_without_a_known_price_launches_nothing(tmp_path: Path, host: SshHost) -> None:
    body = one_step(command=["/bin/sh", "-c", "echo made > out.txt"], outputs=["out.txt"], max_cost=2.5)
    root = make_ssh_project(tmp_path, host, body, remote_root=str(host.scratch / "remote-unpriced"))
    done = doit(root, timeout=120)
    assert done.returncode == 1, show(done)
    said = done.stdout + done.stderr
    assert "max_cost = $2.5000 cannot be kept" in said, show(done)
    assert "set hourly_cost" in said and "[tool.substrax.compute.backends.ssh]" in said, show(done)
    handle = only_handle(root)
    assert handle["backend_state"].get("remote_run_dir") is None  # not even a folder on the host
    assert not (host.scratch / "remote-unpriced" / "runs").exists()
    assert not (root / "out.txt").exists()
    [run] = status_runs(root)
    assert run["state"] == "failed" and "cannot be kept" in run["message"], run


def test_the_host_stops_a_run_at_its_cap_with_its_client_killed(tmp_path: Path, host: SshHost) -> None:
    marker = f"capped-{uuid.uuid4().hex[:8]}"
    # $0.20 at a cent a second: the command has run a while when the cap comes.
    body = one_step(command=["/bin/sh", "-c", "echo started; sleep 600", marker], outputs=["out.txt"],
                    max_cost=0.2)  # fmt: skip
    root = make_ssh_project(tmp_path, host, body, sandbox="none", hourly_cost=CENT_A_SECOND,
                            remote_root=str(host.scratch / "remote-capped"))  # fmt: skip
    try:
        doit_killed_mid_run(root, marker)  # no client follows the run from here
        handle = only_handle(root)
        wait_for(lambda: (remote_status(handle) or {}).get("state") == "timed_out",
                 "the host to stop the run at its cap", timeout=90)  # fmt: skip
        assert not marked_pids(marker), "the command outlived its cap"
        record = remote_status(handle) or {}
        assert "its cost reached max_cost = $0.2000" in str(record.get("message")), record
        [run] = status_runs(root)
        assert run["state"] == "timed_out" and "max_cost = $0.2000" in run["message"], run
        assert run["max_cost"] == 0.2
        assert run["cost_usd"] >= 0.2, run  # it ran to its cap, from the launch on
        # Its folder there goes with the teardown, and the cost it came to is kept.
        torn = compute(root, "teardown", handle["run_id"])
        assert torn.returncode == 0, show(torn)
        ended = only_handle(root)
        assert not remote_run_dir(ended).exists()
        # At the cap, plus the seconds the stop and this teardown took.
        assert 0.2 <= ended["state"]["cost_usd"] < 0.2 + 0.6, ended["state"]
    finally:
        for pid in marked_pids(marker):  # only if a failure above left it
            kill_pid(pid)


def test_the_runs_guard_stops_it_at_its_cap_when_its_client_and_its_worker_are_killed(
    tmp_path: Path, host: SshHost
) -> None:
    """The worker on the host killed too (as its OOM killer may): the run's
    guard there stops the command at the cap, before the lifetime timer
    (armed for the cap plus grace and 10 s) would, and records why."""
    marker = f"guarded-{uuid.uuid4().hex[:8]}"
    body = one_step(command=["/bin/sh", "-c", "echo started; sleep 600", marker], outputs=["out.txt"],
                    max_cost=0.2)  # fmt: skip
    root = make_ssh_project(tmp_path, host, body, sandbox="none", hourly_cost=CENT_A_SECOND,
                            remote_root=str(host.scratch / "remote-guarded"))  # fmt: skip
    try:
        doit_killed_mid_run(root, marker)
        handle = only_handle(root)
        wait_for(lambda: (remote_status(handle) or {}).get("state") == "running", "the run's record there")
        record = remote_status(handle) or {}
        kill_pid(record["worker_pid"])
        wait_for(lambda: (remote_status(handle) or {}).get("state") == "timed_out",
                 "the run's guard to stop the run at its cap", timeout=90)  # fmt: skip
        assert not marked_pids(marker), "the command outlived its cap"
        ended = remote_status(handle) or {}
        message = str(ended.get("message"))
        assert "its cost reached max_cost = $0.2000" in message, ended
        assert "its worker was gone, so the run's guard stopped the command" in message, ended
    finally:
        for pid in marked_pids(marker):  # only if a failure above left it
            kill_pid(pid)


def test_a_launch_that_failed_costs_its_time_until_it_failed(tmp_path: Path, host: SshHost) -> None:
    blocker = host.scratch / "a-file-not-a-folder"
    blocker.write_text("")  # the remote root under it cannot be made: the launch fails
    body = one_step(command=["/bin/sh", "-c", "echo made > out.txt"], outputs=["out.txt"])
    root = make_ssh_project(tmp_path, host, body, hourly_cost=CENT_A_SECOND,
                            remote_root=str(blocker / "remote"))  # fmt: skip
    try:
        done = doit(root, timeout=120)
    finally:
        blocker.unlink()
    assert done.returncode != 0, show(done)
    handle = only_handle(root)
    asked = handle["state"]["machine"]["asked_at"]
    failed = datetime.fromisoformat(handle["state"]["times"]["launch"]["end"]).timestamp()
    [run] = status_runs(root)
    # Counted up to the launch's failure, not on and on from there.
    assert run["machine_seconds"] == pytest.approx(failed - asked)
    assert run["cost_usd"] == pytest.approx((failed - asked) * 0.01)
