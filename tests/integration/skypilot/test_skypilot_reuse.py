"""SkyPilot clusters reused across steps (`reuse = true`), through the real
`doit` and helper against the fake SkyPilot (its `exec` queues a job on an
UP cluster without setup or file mounts, as the SDK's does), with the
clusters' ssh served by a real sshd in a network namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from dodo_helpers import (
    clean_env,
    doit,
    doit_ok,
    popen_doit,
    popen_output,
    run_count,
    show,
    step_skipped,
    stop,
    wait_for,
)
from local_runs import marked_pids
from sky_beds import Sky
from ssh_helpers import live_handles, needs_root, needs_sshd, write_ssh_dodo

pytestmark = [needs_sshd, needs_root]

SWEEP = """
def task_fit():
    for m in range({steps}):
        yield from remote_step(
            f"fit:m{{m}}", inputs=["data/in.txt"], outputs=[f"fit-{{m}}.txt"], timeout={timeout},
            shell=f"cat data/in.txt > fit-{{m}}.txt; echo m{{m}} >> fit-{{m}}.txt", resources={{"cpus": 1}},
        )
"""


def sweep(project: Sky, steps: int, timeout: float, max_parallel: int) -> None:
    project.configure(reuse=True, max_parallel=max_parallel)
    write_ssh_dodo(project.root, SWEEP.format(steps=steps, timeout=timeout), ["fit"])
    (project.root / "data").mkdir()
    (project.root / "data" / "in.txt").write_text("hello\n")


def clusters_used(project: Sky) -> list[str]:
    runs = project.root / ".substrax" / "runs"
    return [json.loads(p.read_text())["backend_state"]["cluster"] for p in sorted(runs.glob("*/handle.json"))]


def test_a_threaded_sweep_takes_turns_on_at_most_max_parallel_clusters_and_leaves_none(sky: Sky) -> None:
    sweep(sky, steps=6, timeout=60, max_parallel=2)
    done = doit(sky.root, "-n", "4", "-P", "thread", env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    for m in range(6):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"hello\nm{m}\n"
    used = clusters_used(sky)
    assert len(used) == 6 and len(set(used)) == 2, used  # two launched, four queued on them
    assert done.stdout.count("launching cluster") == 2, show(done)
    assert done.stdout.count("queued on warm cluster") == 4, show(done)
    assert "waits for a free slot on SkyPilot (cpus=1) (2 running)" in done.stdout, show(done)
    assert sky.clusters() == []  # the last user took each down as doit ended
    status = sky.compute("status", "--all", "--json")
    assert {r["state"] for r in json.loads(status.stdout)["runs"]} == {"succeeded"}, status.stdout
    asked = sky.requests()
    again = doit_ok(sky.root, "-n", "4", "-P", "thread", env=sky.env)
    assert all(step_skipped(again, f"fit:m{m}") for m in range(6)), show(again)
    assert sky.requests() == asked and run_count(sky.root) == 6


def test_a_cluster_without_lifetime_left_for_the_timeout_is_replaced_not_reused(sky: Sky) -> None:
    # 9 minutes of lifetime (10 less idle_minutes): a timeout of 8 leaves less than the margin.
    sweep(sky, steps=2, timeout=480, max_parallel=1)
    done = doit(sky.root, env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    first, second = clusters_used(sky)
    assert first != second, show(done)
    assert f"not reusing cluster {first} (" in done.stdout and "too few for the step's timeout" in done.stdout
    assert sky.clusters() == []


# Two steps of one shape: m0 waits for the gate (its processes carry the
# marker), m1 is quick. Filled in with str.format.
GATED_PAIR = """
def task_fit():
    yield from remote_step(
        "fit:m0", outputs=["fit-0.txt"], timeout=60, resources={{"cpus": 1}},
        command=["/bin/sh", "-c", "while [ ! -e {gate} ]; do sleep 0.05; done; echo 0 > fit-0.txt",
                 {marker!r}],
    )
    yield from remote_step("fit:m1", outputs=["fit-1.txt"], timeout=60, resources={{"cpus": 1}},
                           shell="echo 1 > fit-1.txt")
"""


def test_cancel_of_a_run_on_a_shared_cluster_cancels_its_job_only(sky: Sky, marker: str) -> None:
    # Unsandboxed: the sandbox's private /tmp would hide the gate from the job.
    sky.configure(reuse=True, max_parallel=1, sandbox="none")
    write_ssh_dodo(sky.root, GATED_PAIR.format(gate=str(sky.base / "gate"), marker=marker), ["fit"])
    proc = popen_doit(sky.root, "--continue", env=sky.env)  # serially: m0, then m1
    try:
        wait_for(lambda: marked_pids(marker), "m0's job to run", timeout=120)
        (first,) = [h for h in live_handles(sky.root) if h["step"] == "fit:m0"]
        cancelled = sky.compute("cancel", first["run_id"])
        assert cancelled.returncode == 0, cancelled.stderr
        assert proc.wait(timeout=300) != 0  # m0 was cancelled
    finally:
        stop(proc)
    said = popen_output(sky.root)
    assert "queued on warm cluster" in said, said
    assert len(set(clusters_used(sky))) == 1, said  # m1 ran on m0's cluster, which the cancel left up
    assert (sky.root / "fit-1.txt").read_text() == "1\n"
    status = json.loads(sky.compute("status", first["run_id"], "--json").stdout)
    assert status["runs"][0]["state"] == "cancelled", status
    assert marked_pids(marker) == []
    assert sky.clusters() == []


def test_steps_queued_on_a_warm_cluster_reach_the_home_its_jobs_run_in(sky: Sky) -> None:
    """The default, relative remote_root, on a cluster whose ssh starts
    outside the jobs' home (see test_skypilot_chain): a queued job runs no
    setup, so never prints its home; its files go, and its outputs are
    fetched, where the launching run's job printed it. Each warm run records
    the lifetime its job armed: the cluster's, counted from its launch."""
    sweep(sky, steps=3, timeout=60, max_parallel=1)
    sky.configure(reuse=True, max_parallel=1, remote_root=".substrax-remote")
    done = doit(sky.root, env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    for m in range(3):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"hello\nm{m}\n"
    assert done.stdout.count("queued on warm cluster") == 2, show(done)
    runs = sky.root / ".substrax" / "runs"
    handles = [json.loads(p.read_text()) for p in sorted(runs.glob("*/handle.json"))]
    (cluster,) = {h["backend_state"]["cluster"] for h in handles}
    home = sky.home / ".fakesky" / "clusters" / cluster / "home"
    assert {h["backend_state"]["job_home"] for h in handles} == {str(home.resolve())}, show(done)
    launched = next(h for h in handles if h["step"] == "fit:m0")["backend_state"]["watchdog"]
    for h in handles:
        timer = h["backend_state"]["watchdog"]
        assert timer["armed_at"] + timer["seconds"] <= launched["armed_at"] + launched["seconds"]
    assert sky.clusters() == []


def queued_job(project: Sky, step: str) -> dict[str, Any] | None:
    """The handle of `step`'s run while its job waits in SkyPilot's queue."""
    for handle in live_handles(project.root):
        state = handle["backend_state"]
        if handle["step"] != step or not isinstance(state.get("job_id"), int):
            continue
        job = project.home / ".fakesky" / "clusters" / state["cluster"] / "jobs" / f"{state['job_id']}.json"
        if job.is_file() and json.loads(job.read_text())["status"] == "PENDING":
            return handle
    return None


def job_status_reads(project: Sky) -> int:
    requests = project.home / ".fakesky" / "requests"
    return sum(json.loads(p.read_text())["name"] == "job_status" for p in requests.glob("*/request.json"))


def test_a_job_queued_behind_another_waits_its_turn_then_ends_as_its_run(sky: Sky) -> None:
    """m1's job waits in SkyPilot's queue while m0's still reads RUNNING there
    (its driver lags the run's end); then it runs, is followed, and comes
    home."""
    lag = sky.base / "m0-job-ends"
    sky.env.update(FAKESKY_QUEUE_JOBS="1", FAKESKY_JOB_END_GATE=str(lag))
    sweep(sky, steps=2, timeout=60, max_parallel=1)
    proc = popen_doit(sky.root, env=sky.env)
    try:
        wait_for(lambda: queued_job(sky, "fit:m1"), "m1's job to wait in SkyPilot's queue", timeout=120)
        lag.touch()  # SkyPilot's driver sees m0's job end: m1's runs
        code = proc.wait(timeout=300)
    finally:
        stop(proc)
    said = popen_output(sky.root)
    assert code == 0, said
    assert "queued on warm cluster" in said, said
    for m in range(2):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"hello\nm{m}\n"
    assert len(set(clusters_used(sky))) == 1, said
    assert sky.clusters() == []


def test_a_job_cancelled_in_skypilots_queue_before_it_started_ends_its_step_as_cancelled(
    sky: Sky,
) -> None:
    """While a job waits in SkyPilot's queue (here behind m0's, which reads
    RUNNING there until the cluster goes), the client polls it: no follower
    waits on a worker that never starts. SkyPilot cancels it from its queue
    (as `sky cancel` would), and the step ends cancelled."""
    sky.env.update(FAKESKY_QUEUE_JOBS="1", FAKESKY_JOB_END_GATE=str(sky.base / "never"))
    sweep(sky, steps=2, timeout=60, max_parallel=1)
    proc = popen_doit(sky.root, env=sky.env)
    try:
        def waited_on() -> dict[str, Any] | None:
            handle = queued_job(sky, "fit:m1")
            return handle if handle is not None and handle["state"].get("phase") == "started" else None

        wait_for(waited_on, "m1's client to wait on its job in SkyPilot's queue", timeout=120)
        handle = waited_on()
        assert handle is not None
        # Two reads of the queue since: the first said PENDING before the cancel below.
        reads = job_status_reads(sky)
        wait_for(lambda: job_status_reads(sky) >= reads + 2, "the client to read the job's status")
        state = handle["backend_state"]
        cancel = f"import sky; sky.get(sky.cancel({state['cluster']!r}, job_ids=[{state['job_id']}]))"
        done = subprocess.run([sys.executable, "-c", cancel], env=clean_env(sky.env), capture_output=True,
                              text=True, timeout=120, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        code = proc.wait(timeout=120)  # not held by a follower of the job that never ran
    finally:
        stop(proc)
    said = popen_output(sky.root)
    assert code != 0, said
    assert (sky.root / "fit-0.txt").read_text() == "hello\nm0\n"
    assert not (sky.root / "fit-1.txt").exists()
    status = json.loads(sky.compute("status", handle["run_id"], "--json").stdout)
    assert status["runs"][0]["state"] == "cancelled", (status, said)
    assert sky.clusters() == []
