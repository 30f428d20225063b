"""A SkyPilot cluster lost while a step's command runs (`remote_step(...,
preemptions=N)`), through the real `doit` and helper against the fake
SkyPilot, its clusters' ssh served by a real sshd in a network namespace.

The fake takes a cluster away as SkyPilot 0.14 shows a preemption or a
cancelled Slurm allocation (measured on the Slurm bed; see
SkypilotBackend.poll): every process of it dies, ssh to it fails, and its
record still reads UP until a status refresh removes it. A cluster that
only stops answering over ssh while SkyPilot holds it UP is waited for and
followed again, never relaunched."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from checkpoint_parts import COUNT_PY, count_step, kept_state, result_of, starts
from dodo_helpers import clean_env, doit, pid_alive, popen_doit, popen_output, stop, wait_for
from local_runs import marked_pids
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
from progress import wait_exit
from sky_beds import Sky
from ssh_helpers import live_handles, needs_root, needs_sshd, only_handle, write_ssh_dodo
from testbeds.sshd_host import SshHost, kill_sshd, restart_sshd

pytestmark = [needs_sshd, needs_root]

COUNTS = 14
PAUSE = 0.3  # a count every PAUSE seconds
EVERY = 0.5  # checkpoint_seconds


@pytest.fixture
def marker() -> str:
    import secrets

    return f"{secrets.randbelow(10**6):06d}"


def counting(sky: Sky, marker: str, preemptions: int, **settings: Any) -> None:
    """A step counting to COUNTS, its checkpoint written by rename and read
    back as it starts (checkpoint_parts.COUNT_PY); its argv carries the
    test's marker, by which its processes are found. Started from nothing it
    holds after count 3 until `release` (the test takes its cluster away
    while it holds, however late the snapshot of 3 counts comes home)."""
    sky.configure(checkpoint_seconds=EVERY, **settings)
    body = count_step("count", COUNTS, PAUSE, f"marker-{marker}", "hold-after-3", preemptions=preemptions,
                      timeout=120)  # fmt: skip
    write_ssh_dodo(sky.root, "def task_all():\n" + body, ["count"])
    (sky.root / "count.py").write_text(COUNT_PY)
    (sky.root / "data.txt").write_text("one\n")


def preempt(sky: Sky, cluster: str) -> None:
    """Take the cluster away behind SkyPilot's back (the fake's `preempt`)."""
    done = subprocess.run(
        [sys.executable, "-m", "sky", "preempt", str(sky.home / ".fakesky"), cluster],
        env=clean_env(sky.env), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def release(marker: str) -> None:
    """Let the count held after 3 go on: `ckpt/go` in its working folder on
    the cluster (the fake's clusters are folders of this machine)."""
    (pid,) = [pid for pid in marked_pids(marker) if Path(f"/proc/{pid}/comm").read_text().startswith("py")]
    (Path(f"/proc/{pid}/cwd") / "ckpt" / "go").write_text("")


def running_cluster(sky: Sky, marker: str) -> tuple[str, int]:
    """The run's cluster once a snapshot of 3 counts is home, and the count that snapshot holds."""
    wait_for(lambda: (kept_state(sky.root, "count") or {}).get("i", 0) >= 3, "a snapshot of 3 counts",
             timeout=120)  # fmt: skip
    assert marked_pids(marker), popen_output(sky.root)
    cluster: str = live_handles(sky.root, "count")[0]["backend_state"]["cluster"]
    return cluster, int((kept_state(sky.root, "count") or {})["i"])


def doit_through_a_preemption(sky: Sky, marker: str) -> tuple[int, str, str]:
    """`doit` with its cluster taken away once a snapshot of 3 counts is
    home: doit's exit code, what it said, and the cluster it lost."""
    proc = popen_doit(sky.root, env=sky.env)
    try:
        lost, _ = running_cluster(sky, marker)
        preempt(sky, lost)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    return code, popen_output(sky.root), lost


def attempts_of(sky: Sky) -> list[dict[str, Any]]:
    attempts: list[dict[str, Any]] = only_handle(sky.root, "count")["state"]["attempts"]
    return attempts


def launches(sky: Sky) -> list[dict[str, Any]]:
    """The launch requests the fake's API server got, oldest first: what SkyPilot was asked for."""
    found = []
    for folder in (sky.home / ".fakesky" / "requests").iterdir():
        record = json.loads((folder / "request.json").read_text())
        if record["name"] == "launch":
            found.append((record["created_at"], json.loads((folder / "args.json").read_text())))
    return [args for _, args in sorted(found, key=lambda pair: pair[0])]


def test_a_cluster_taken_away_mid_run_is_relaunched_on_a_new_one_from_the_last_snapshot(
    sky: Sky, marker: str
) -> None:
    counting(sky, marker, preemptions=1)
    proc = popen_doit(sky.root, env=sky.env)
    try:
        lost, kept = running_cluster(sky, marker)
        preempt(sky, lost)
        taken = time.time()
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    said = popen_output(sky.root)
    assert code == 0, said
    # each count once in the history the checkpoint carries; the second attempt went on from a snapshot
    assert result_of(sky.root, "count") == (COUNTS, list(range(1, COUNTS + 1))), said
    fresh, resumed = starts(said)
    assert fresh == 0 and resumed >= kept, said
    first, second = attempts_of(sky)
    assert (first["number"], first["outcome"], first["machine"]) == (1, "lost", lost), first
    assert f"its cluster {lost} is gone" in first["message"], first
    assert (second["number"], second["outcome"]) == (2, "succeeded"), second
    assert second["machine"] != lost and second["machine"].startswith("substrax-"), second
    assert second["snapshot"] is not None, second
    assert "attempt 1 lost its machine" in said and f"the lost cluster {lost} is taken down" in said, said
    assert "checkpoints put in place from the last snapshot" in said, said
    assert [args["cluster_name"] for args in launches(sky)] == [lost, second["machine"]]
    # the new cluster's lifetime counts from its own launch
    watchdog = only_handle(sky.root, "count")["backend_state"]["watchdog"]
    assert watchdog["armed_at"] >= taken, watchdog
    # nothing of either attempt is left: the new cluster went with the run (reuse = false)
    assert sky.clusters() == []
    assert marked_pids(marker) == []


def test_with_reuse_the_lost_cluster_leaves_its_slot_and_the_new_one_stays_warm(
    sky: Sky, marker: str
) -> None:
    counting(sky, marker, preemptions=1, reuse=True, max_parallel=1, idle_minutes=60)
    proc = popen_doit(sky.root, env=sky.env)
    try:
        lost, _ = running_cluster(sky, marker)
        (record,) = (sky.root / ".substrax" / "slots").glob("skypilot-*/0.json")
        assert json.loads(record.read_text())["cluster"] == lost
        preempt(sky, lost)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    said = popen_output(sky.root)
    assert code == 0, said
    assert result_of(sky.root, "count") == (COUNTS, list(range(1, COUNTS + 1))), said
    first, second = attempts_of(sky)
    assert (first["outcome"], second["outcome"]) == ("lost", "succeeded")
    # the slot holds the new cluster, kept warm for the next step; the lost one is gone
    assert json.loads(record.read_text())["cluster"] == second["machine"] != lost
    assert sky.clusters() == [second["machine"]]


def test_with_no_preemption_allowed_the_step_fails_naming_the_lost_cluster_and_preemptions(
    sky: Sky, marker: str
) -> None:
    counting(sky, marker, preemptions=0)
    code, said, lost = doit_through_a_preemption(sky, marker)
    assert code == 1, said
    assert f"its cluster {lost} is gone" in said, said
    assert "remote_step('count', ..., preemptions=1) relaunches it" in said, said
    assert "relaunching" not in said and "Traceback" not in said, said
    (attempt,) = attempts_of(sky)
    assert attempt["outcome"] == "lost", attempt
    assert len(launches(sky)) == 1
    assert not (sky.root / "count.txt").exists()
    assert kept_state(sky.root, "count") is not None  # its snapshot stays for the next doit


def test_a_cluster_that_stops_answering_while_skypilot_holds_it_up_is_waited_for_not_relaunched(
    sky: Sky, marker: str, cluster_host: SshHost
) -> None:
    counting(sky, marker, preemptions=1)
    proc = popen_doit(sky.root, env=sky.env)
    try:
        running_cluster(sky, marker)
        kill_sshd(cluster_host)  # every ssh session to it ends; the worker, detached, goes on
        try:
            wait_for(lambda: "does not answer" in popen_output(sky.root), "the client to lose it", 120)
            assert marked_pids(marker), "the command stopped with the ssh sessions"
        finally:
            restart_sshd(cluster_host)
        release(marker)
        code = wait_exit(proc, "the doit to end", 300)
    finally:
        stop(proc)
    said = popen_output(sky.root)
    assert code == 0, said
    assert "its machine answers again; following the run" in said, said
    assert "relaunching" not in said and "Traceback" not in said, said
    assert starts(said) == [0], said  # the command never started again
    (attempt,) = attempts_of(sky)
    assert attempt["outcome"] == "succeeded", attempt
    assert len(launches(sky)) == 1
    assert result_of(sky.root, "count") == (COUNTS, list(range(1, COUNTS + 1))), said


def test_on_spot_the_last_attempt_preemptions_allow_is_launched_on_demand(sky: Sky, marker: str) -> None:
    counting(sky, marker, preemptions=1, use_spot=True, on_demand_last_attempt=True)
    code, said, _ = doit_through_a_preemption(sky, marker)
    assert code == 0, said
    assert "attempt 2 is the last preemptions= allow: on an on-demand machine" in said, said
    # as SkyPilot was asked, and as each attempt's intent is kept beside the run
    spot = [args["task_config"]["resources"].get("use_spot", False) for args in launches(sky)]
    assert spot == [True, False], spot
    run = sky.root / ".substrax" / "runs" / only_handle(sky.root, "count")["run_id"]
    names = ("task.json", "task-attempt2.json")
    intents = [json.loads((run / name).read_text())["resources"] for name in names]
    assert [r.get("use_spot") for r in intents] == [True, False], intents
    assert [a["outcome"] for a in attempts_of(sky)] == ["lost", "succeeded"]
    assert result_of(sky.root, "count") == (COUNTS, list(range(1, COUNTS + 1))), said


def test_on_demand_last_attempt_without_use_spot_is_refused_with_the_fix(sky: Sky, marker: str) -> None:
    counting(sky, marker, preemptions=1, on_demand_last_attempt=True)
    done = doit(sky.root, env=sky.env)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "on_demand_last_attempt" in said and "set use_spot = true" in said, said
    assert not (sky.home / ".fakesky" / "requests").exists()


def test_a_spot_attempt_and_its_on_demand_relaunch_are_each_priced_as_launched(sky: Sky, marker: str) -> None:
    # m6i.large in the fake's catalog: one price on demand, a lower one on spot.
    counting(sky, marker, preemptions=1, use_spot=True, on_demand_last_attempt=True, infra="aws",
             instance_type="m6i.large")  # fmt: skip
    code, said, _ = doit_through_a_preemption(sky, marker)
    assert code == 0, said
    done = sky.compute("status", "--json")
    assert done.returncode == 0, done.stderr
    [run] = json.loads(done.stdout)["runs"]
    spot, on_demand = run["attempts"]
    assert (spot["outcome"], on_demand["outcome"]) == ("lost", "succeeded"), run["attempts"]
    assert on_demand["hourly_cost"] == pytest.approx(0.096), on_demand
    assert 0 < spot["hourly_cost"] < on_demand["hourly_cost"], spot
    # The run costs both machines, each at its own price; the price it shows is the machine's it holds last.
    assert run["cost_usd"] == pytest.approx(spot["cost_usd"] + on_demand["cost_usd"])
    assert spot["cost_usd"] == pytest.approx(spot["machine_seconds"] * spot["hourly_cost"] / 3600)
    assert run["machine_seconds"] == pytest.approx(spot["machine_seconds"] + on_demand["machine_seconds"])
    assert run["hourly_cost"] == pytest.approx(0.096)
    assert "$0.0960/h on skypilot" in said and "(as launched)" in said, said


LOST_STEP = """
def task_work():
    yield from remote_step("work", command={argv!r}, outputs=["out/result.txt"], preemptions=1)
"""


def test_with_reuse_a_killed_workers_tree_on_the_cluster_is_stopped_before_the_relaunch_starts(
    sky: Sky, tmp_path: Path
) -> None:
    """reuse = true, sandbox = "none": the worker on a cluster SkyPilot
    holds UP is killed while doit follows the run; its command, a setsid
    grandchild and a child with no environment go on. The relaunch stops
    them and removes the lost attempt's folder before attempt 2's command
    starts (which records any process of attempt 1 it finds alive)."""
    marker = f"substrax-sky-lost-{tmp_path.name}"
    flags = tmp_path / "flags"
    write_command(flags)
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60, sandbox="none")
    write_ssh_dodo(sky.root, LOST_STEP.format(argv=step_argv(flags, marker, "out/result.txt")), ["work"])
    proc = popen_doit(sky.root, env=sky.env)
    try:
        old = wait_tree_up(flags)
        run_folder = Path(live_handles(sky.root, "work")[0]["backend_state"]["remote_run"])
        kill_worker(json.loads((run_folder / "status.json").read_text()))
        code = wait_exit(proc, "the doit to end", 300)
        said = popen_output(sky.root)
        assert code == 0, said
        assert "relaunching it, attempt 2 of at most 2" in said, said
        assert overlap(flags) == [], "attempt 2 started while these of attempt 1's tree ran"
        assert not [pid for pid in old if pid_alive(pid)], old
        # Its folder removed (a `lease-claim` written there afterwards is the lease's, left alone here)
        assert not (run_folder / "status.json").exists() and not (run_folder / "project").exists()
        assert (sky.root / "out" / "result.txt").read_text() == "done\n"
    finally:
        stop(proc)
        kill_recorded(flags, marker)


def test_with_reuse_a_relaunched_attempt_is_the_one_its_clusters_lease_holds_then_lets_go(
    sky: Sky, tmp_path: Path
) -> None:
    """reuse = true: the worker alone lost, the run is relaunched on a
    cluster whose lease is claimed for the new attempt's run, in its own
    folder (`<run>-attempt2`): once the step is done the lease ends after
    idle_minutes and SkyPilot takes the cluster down. A claim made in the
    lost attempt's folder held the cluster for half an hour more."""
    marker = f"substrax-sky-lease-{tmp_path.name}"
    flags = tmp_path / "flags"
    write_command(flags)
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"  # the autodown fires 2 s after the lease ended
    sky.configure(reuse=True, max_parallel=1, idle_minutes=0.1, sandbox="none")  # the lease: 6 s idle
    write_ssh_dodo(sky.root, LOST_STEP.format(argv=step_argv(flags, marker, "out/result.txt")), ["work"])
    proc = popen_doit(sky.root, env=sky.env)
    try:
        wait_tree_up(flags)
        handle = live_handles(sky.root, "work")[0]
        kill_worker(json.loads((Path(handle["backend_state"]["remote_run"]) / "status.json").read_text()))
        code = wait_exit(proc, "the doit to end", 300)
        said = popen_output(sky.root)
        assert code == 0, said
        attempts = only_handle(sky.root, "work")["state"]["attempts"]
        assert [a["outcome"] for a in attempts] == ["lost", "succeeded"], attempts
        assert not (sky.remote / "runs" / handle["run_id"]).exists(), "a claim in the lost attempt's folder"
        wait_for(lambda: sky.clusters() == [], "the lease to end and SkyPilot to take the cluster down",
                 timeout=60)  # fmt: skip
    finally:
        stop(proc)
        kill_recorded(flags, marker)


def test_with_reuse_a_lost_workers_process_that_will_not_stop_keeps_the_relaunch_from_starting_beside_it(
    sky: Sky, tmp_path: Path
) -> None:
    """reuse = true, sandbox = "none": the worker on a cluster SkyPilot
    holds UP is killed and one process of its command's tree cannot be
    stopped (frozen: a SIGKILL waits until it thaws). The relaunch, which
    would take the same warm cluster, starts no attempt 2 beside it: the
    step fails naming the process. Once it is gone, the next doit runs the
    step anew."""
    marker = f"substrax-sky-lost-{tmp_path.name}"
    flags = tmp_path / "flags"
    write_command(flags)
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60, sandbox="none")
    write_ssh_dodo(sky.root, LOST_STEP.format(argv=step_argv(flags, marker, "out/result.txt")), ["work"])
    proc = popen_doit(sky.root, env=sky.env)
    try:
        old = wait_tree_up(flags)
        stuck = old[1]
        run_folder = Path(live_handles(sky.root, "work")[0]["backend_state"]["remote_run"])
        with frozen(stuck, f"substrax-test-{tmp_path.name}"):
            record = json.loads((run_folder / "status.json").read_text())
            kill_worker(record)
            code = wait_exit(proc, "the doit to end", 300)
            started = recorded_pids(flags)
        wait_for(lambda: not pid_alive(stuck), "the thawed process to end by the SIGKILL it was sent")
        said = popen_output(sky.root)
        assert code == 2, said
        assert f"(pid {stuck}) did not stop" in said and "no new attempt starts beside it" in said, said
        assert "Traceback" not in said, said
        assert len(started) == 3, "attempt 2 started beside the lost attempt's process"
        again = doit(sky.root, env=sky.env, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert overlap(flags) == [], "the new run started beside the lost one's tree"
        assert (sky.root / "out" / "result.txt").read_text() == "done\n"
    finally:
        stop(proc)
        kill_recorded(flags, marker)
