"""remote/lease.py's handshake, on its files: a claim is given only by a
lease that holds the cluster, and a claimed run holds the lease until it
ends. The lease here is this test's own process (alive, as a lease's would
be); its loop (`hold`) runs in the integration tests
(tests/integration/skypilot/test_skypilot_warm.py)."""

from __future__ import annotations

import json
import os
import pwd
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from substrax_tasks._remote import control, lease


def held_by(root: Path, cluster: str, pid: int, state: str = "held") -> Path:
    folder = Path(lease.lease_dir(str(root), cluster))
    folder.mkdir(parents=True)
    record = {"state": state, "pid": pid, "start_ticks": control.start_ticks(pid), "idle_seconds": 60,
              "busy": [], "idle_since": time.time(), "started_at": time.time()}  # fmt: skip
    (folder / lease.RECORD).write_text(json.dumps(record))
    return folder


@pytest.mark.unit
def test_a_lease_that_holds_gives_the_cluster_and_counts_the_claimed_run_as_going(tmp_path: Path) -> None:
    held_by(tmp_path, "c1", os.getpid())
    answer = lease.claim(str(tmp_path), "c1", "run-1")
    assert answer["claimed"] is True
    run_dir = tmp_path / "runs" / "run-1"
    assert lease.claimed_for(str(run_dir)) == "c1"
    # no status yet (its client syncs its files): it holds the lease
    assert lease.runs_going(str(tmp_path), "c1", time.time()) == ["run-1"]
    assert lease.runs_going(str(tmp_path), "c2", time.time()) == []  # another lease on a shared root
    # a status whose worker is gone and that says the run ended: no longer going
    (run_dir / control.STATUS_FILE).write_text(json.dumps({"state": "succeeded", "worker_pid": None}))
    assert lease.runs_going(str(tmp_path), "c1", time.time()) == []
    assert lease.last_end(str(tmp_path), "c1") > 0
    # a claim nobody started holds the lease only so long
    later = time.time() + lease.CLAIM_HOLD_SECONDS + 1
    lease.claim(str(tmp_path), "c1", "run-2")
    assert lease.runs_going(str(tmp_path), "c1", later) == []


@pytest.mark.unit
def test_a_lease_that_ended_or_died_or_never_started_gives_nothing(tmp_path: Path) -> None:
    assert lease.claim(str(tmp_path), "none", "run-1")["claimed"] is False  # no lease folder yet
    held_by(tmp_path, "ended", os.getpid(), state="ended")
    refused = lease.claim(str(tmp_path), "ended", "run-1")
    assert (refused["claimed"], refused["state"]) == (False, "ended")
    dead = 2**22 + 12345  # above pid_max's default: no such process
    held_by(tmp_path, "dead", dead)
    assert lease.claim(str(tmp_path), "dead", "run-1")["state"] == "ended"
    assert not (tmp_path / "runs" / "run-1").exists()  # nothing was given a refused run
    assert lease.status(str(tmp_path), "dead")["state"] == "ended"
    assert lease.status(str(tmp_path), "ended")["idle_left"] is None


@pytest.mark.unit
def test_a_lease_of_a_relative_root_says_its_home_where_ssh_lands_and_touches_no_other_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The home file (relative to the login's home, which is tmp_path/login
    here) names the folder the lease runs in; a claim answers that home, so
    the client learns it in the call that claims; another cluster's file,
    even one naming a home that is not a folder here (another node's), is
    left as it is."""
    login, job_home = tmp_path / "login", tmp_path / "jobs" / "c1"
    job_home.mkdir(parents=True)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: SimpleNamespace(pw_dir=str(login)))
    monkeypatch.chdir(job_home)
    gone = login / ".substrax-remote" / "job-homes" / "c0"
    gone.parent.mkdir(parents=True)
    gone.write_text(str(tmp_path / "jobs" / "c0") + "\n")  # not a folder here: another node's home
    path = lease.job_home_file(".substrax-remote", "c1")
    assert path == str(login / ".substrax-remote" / "job-homes" / "c1")
    lease.write_job_home(path)
    assert Path(path).read_text() == f"{job_home}\n"
    assert gone.read_text() == str(tmp_path / "jobs" / "c0") + "\n"
    held_by(job_home / ".substrax-remote", "c1", os.getpid())
    answer = lease.claim(".substrax-remote", "c1", "run-1")
    assert answer["claimed"] is True and answer["job_home"] == str(job_home)
    assert "job_home" not in lease.claim(str(job_home / ".substrax-remote"), "c1", "run-2")
    lease.remove_job_home(path)
    assert not Path(path).exists()
