"""Warm SkyPilot clusters (`reuse = true`): a cluster's one SkyPilot job is
its lease (remote/lease.py), every step runs on it through the worker over
ssh, and the next `doit` finds it warm. Through the real `doit` and helper
against the fake SkyPilot (its autodown takes a cluster down once its job
queue has been idle for a fake minute), with the clusters' ssh served by a
real sshd in a network namespace."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

from dodo_helpers import doit, doit_ok, popen_doit, show, stop, wait_for
from local_runs import marked_pids
from progress import wait_exit
from sky_beds import Sky, two_gpu_python
from ssh_helpers import live_handles, needs_root, needs_sshd, write_ssh_dodo

pytestmark = [needs_sshd, needs_root]

MINUTE = 2.0  # a fake SkyPilot minute: the autodown fires this long after the lease ended
IDLE_MINUTES = 0.1  # the lease holds a cluster 6 s after its last step

ONE = """
def task_fit():
    yield from remote_step(
        "fit", inputs=["data/in.txt"], outputs=["fit.txt"], timeout=60, resources={"cpus": 1},
        shell="cat data/in.txt > fit.txt",
    )
"""

SWEEP = """
def task_fit():
    for m in range(4):
        yield from remote_step(
            f"fit:m{m}", inputs=["data/in.txt"], outputs=[f"fit-{m}.txt"], timeout=60,
            shell=f"cat data/in.txt > fit-{m}.txt; echo m{m} >> fit-{m}.txt", resources={"cpus": 1},
        )
"""

# The step waits for a gate (its processes carry the marker). Filled in with str.format.
GATED = """
def task_fit():
    yield from remote_step(
        "fit", inputs=["data/in.txt"], outputs=["fit.txt"], timeout=60, resources={{"cpus": 1}},
        command=["/bin/sh", "-c", "while [ ! -e {gate} ]; do sleep 0.05; done; cat data/in.txt > fit.txt",
                 {marker!r}],
    )
"""


def warm_project(sky: Sky, body: str, **settings: Any) -> None:
    sky.env["FAKESKY_MINUTE_SECONDS"] = str(MINUTE)
    values: dict[str, Any] = {"reuse": True, "max_parallel": 1, "idle_minutes": 60}
    values.update(settings)
    sky.configure(**values)
    write_ssh_dodo(sky.root, body, ["fit"])
    (sky.root / "data").mkdir(exist_ok=True)
    (sky.root / "data" / "in.txt").write_text("hello\n")


def clusters_used(sky: Sky) -> list[str]:
    runs = sky.root / ".substrax" / "runs"
    handles = [json.loads(p.read_text()) for p in runs.glob("*/handle.json")]
    return [h["backend_state"]["cluster"] for h in sorted(handles, key=lambda h: h["created_at"])]


def requests_named(sky: Sky, name: str) -> int:
    folder = sky.home / ".fakesky" / "requests"
    return sum(json.loads(p.read_text())["name"] == name for p in folder.glob("*/request.json"))


def skypilot_jobs(sky: Sky, cluster: str) -> list[dict[str, Any]]:
    folder = sky.home / ".fakesky" / "clusters" / cluster / "jobs"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def lease_record(sky: Sky, cluster: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((sky.remote / "leases" / cluster / "lease.json").read_text())
    return record


def test_a_cold_step_then_warm_steps_from_new_doits_run_on_the_cluster_left_warm(sky: Sky) -> None:
    warm_project(sky, ONE)
    first = doit_ok(sky.root, env=sky.env)
    assert "launching cluster" in first.stdout, show(first)
    (cluster,) = sky.clusters()  # doit ended; the cluster stays warm, held by its lease
    for n in range(2):
        (sky.root / "data" / "in.txt").write_text(f"edit {n}\n")  # the loop users live in: edit, doit
        again = doit_ok(sky.root, env=sky.env)
        assert f"on warm cluster {cluster}" in again.stdout and "launching" not in again.stdout, show(again)
        assert (sky.root / "fit.txt").read_text() == f"edit {n}\n"
    assert clusters_used(sky) == [cluster] * 3
    assert requests_named(sky, "launch") == 1 and requests_named(sky, "exec") == 0
    (lease,) = skypilot_jobs(sky, cluster)  # one SkyPilot job: the lease, not one per step
    assert lease["status"] == "RUNNING" and sky.clusters() == [cluster]
    assert lease_record(sky, cluster)["state"] == "held"


def test_a_four_step_sweep_under_threads_takes_turns_on_two_clusters_kept_warm(sky: Sky) -> None:
    warm_project(sky, SWEEP, max_parallel=2)
    done = doit(sky.root, "-n", "4", "-P", "thread", env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    for m in range(4):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"hello\nm{m}\n"
    used = clusters_used(sky)
    assert len(used) == 4 and len(set(used)) == 2, used
    said = done.stdout
    assert said.count("launching cluster") == 2 and said.count("on warm cluster") == 2, show(done)
    assert sorted(sky.clusters()) == sorted(set(used))  # both left warm for the next doit
    assert all(len(skypilot_jobs(sky, c)) == 1 for c in set(used))


def test_a_client_killed_while_a_warm_step_runs_leaves_the_lease_to_hold_then_end_the_cluster(
    sky: Sky, marker: str
) -> None:
    """The step goes on with no client; the lease holds the cluster past its
    idle time while the step runs, ends idle_minutes after the step ended,
    and SkyPilot's autodown then takes the cluster down."""
    gate = sky.base / "gate"
    # Unsandboxed: the sandbox's private /tmp would hide the gate from the step.
    warm_project(sky, ONE, idle_minutes=IDLE_MINUTES, sandbox="none")
    doit_ok(sky.root, env=sky.env)
    (cluster,) = sky.clusters()
    write_ssh_dodo(sky.root, GATED.format(gate=str(gate), marker=marker), ["fit"])
    proc = popen_doit(sky.root, env=sky.env)
    try:
        wait_for(lambda: marked_pids(marker), "the warm step to run", timeout=120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        stop(proc)
    (handle,) = [h for h in live_handles(sky.root) if not h["backend_state"].get("torn_down")]
    assert handle["backend_state"]["cluster"] == cluster
    # Longer than the lease's idle time and SkyPilot's autodown together:
    # the lease holds the cluster while the step runs.
    time.sleep(IDLE_MINUTES * 60 + 2 * MINUTE + 2)
    assert sky.clusters() == [cluster] and marked_pids(marker)
    assert lease_record(sky, cluster)["busy"] == [handle["run_id"]]
    gate.touch()
    wait_for(lambda: not marked_pids(marker), "the step to end", timeout=60)
    wait_for(lambda: sky.clusters() == [], "the lease to end and SkyPilot to take the cluster down",
             timeout=120)  # fmt: skip
    again = doit_ok(sky.root, env=sky.env)  # its run reads as lost (the cluster is gone): launched anew
    assert "launching cluster" in again.stdout, show(again)


def test_the_lifetime_ends_a_warm_cluster_with_no_client(sky: Sky) -> None:
    """lifetime_minutes bounds the cluster from its launch, keep-warm time
    included: the timer armed before its setup ends the lease, SkyPilot's
    autodown takes the cluster down, and the next doit launches anew."""
    warm_project(sky, ONE, idle_minutes=60, copy={"lifetime_minutes": 1.25})  # the timer: 15 s
    first = doit_ok(sky.root, env=sky.env)
    (cluster,) = sky.clusters()
    wait_for(lambda: sky.clusters() == [], "the lifetime to take the warm cluster down", timeout=120)
    (sky.root / "data" / "in.txt").write_text("again\n")
    again = doit_ok(sky.root, env=sky.env)
    assert "launching cluster" in again.stdout and "warm" not in again.stdout, show(first) + show(again)
    assert clusters_used(sky)[0] == cluster != clusters_used(sky)[1]


def test_a_cluster_whose_lease_ended_is_never_given_a_step(sky: Sky) -> None:
    """The slot still names the cluster, but its lease has ended (SkyPilot's
    autodown not yet fired): the claim is refused and a new cluster is
    launched, never a step started on a cluster about to go."""
    warm_project(sky, ONE, idle_minutes=IDLE_MINUTES)
    sky.env["FAKESKY_MINUTE_SECONDS"] = "600"  # SkyPilot takes the old one down only much later
    doit_ok(sky.root, env=sky.env)
    (old,) = sky.clusters()
    wait_for(lambda: lease_record(sky, old)["state"] == "ended", "the lease to end", timeout=60)
    assert sky.clusters() == [old]
    (sky.root / "data" / "in.txt").write_text("again\n")
    again = doit_ok(sky.root, env=sky.env)
    assert f"not reusing cluster {old} (its lease has ended)" in again.stdout, show(again)
    assert "launching cluster" in again.stdout and (sky.root / "fit.txt").read_text() == "again\n"


def test_cancel_of_a_step_on_a_warm_cluster_stops_its_tree_only_and_the_next_step_uses_it(
    sky: Sky, marker: str
) -> None:
    gate = sky.base / "gate"
    warm_project(sky, ONE, sandbox="none")
    doit_ok(sky.root, env=sky.env)
    (cluster,) = sky.clusters()
    write_ssh_dodo(sky.root, GATED.format(gate=str(gate), marker=marker), ["fit"])
    proc = popen_doit(sky.root, env=sky.env)
    try:
        wait_for(lambda: marked_pids(marker), "the warm step to run", timeout=120)
        (handle,) = [h for h in live_handles(sky.root) if not h["backend_state"].get("torn_down")]
        cancelled = sky.compute("cancel", handle["run_id"])
        assert cancelled.returncode == 0, cancelled.stderr
        assert wait_exit(proc, "the doit to end", 120) != 0
    finally:
        stop(proc)
    assert marked_pids(marker) == [] and sky.clusters() == [cluster]
    status = json.loads(sky.compute("status", handle["run_id"], "--json").stdout)
    assert status["runs"][0]["state"] == "cancelled", status
    write_ssh_dodo(sky.root, ONE, ["fit"])
    (sky.root / "data" / "in.txt").write_text("again\n")
    again = doit_ok(sky.root, env=sky.env)
    assert f"on warm cluster {cluster}" in again.stdout, show(again)


def test_teardown_of_a_run_takes_its_warm_cluster_down(sky: Sky) -> None:
    warm_project(sky, ONE)
    doit_ok(sky.root, env=sky.env)
    (cluster,) = sky.clusters()
    (handle,) = [json.loads(p.read_text()) for p in (sky.root / ".substrax" / "runs").glob("*/handle.json")]
    done = sky.compute("teardown", handle["run_id"])
    assert done.returncode == 0, done.stderr
    assert sky.clusters() == []
    slots = sky.root / ".substrax" / "slots"
    assert not [p for p in slots.rglob("*.json") if cluster in p.read_text()]


def test_gc_machines_takes_a_warm_cluster_down(sky: Sky) -> None:
    warm_project(sky, ONE)
    doit_ok(sky.root, env=sky.env)
    (cluster,) = sky.clusters()
    shown = sky.compute("status", "--machines")
    said = shown.stdout + shown.stderr
    assert f"warm cluster {cluster} on SkyPilot: its lease holds it" in said, said
    assert "of its lifetime left" in said, said
    done = sky.compute("gc", "--machines")
    assert done.returncode == 0, done.stderr
    assert sky.clusters() == []
    # the slot forgot it: the next doit launches at once, not after finding it out of reach
    slots = sky.root / ".substrax" / "slots"
    assert not [p for p in slots.rglob("*.json") if cluster in p.read_text()]
    (sky.root / "data" / "in.txt").write_text("edit\n")
    again = doit_ok(sky.root, env=sky.env)
    assert "launching cluster" in again.stdout and "not reusing" not in again.stdout, show(again)


# Two steps that each ask for one of the cluster's two (fake) GPUs: each
# notes the GPUs it was given in the test's folder, then waits for its own
# gate. Filled in with str.format.
GPU_PAIR = """
def task_fit():
    for name in ("a", "b"):
        yield from remote_step(
            f"fit:{{name}}", outputs=[f"fit-{{name}}.txt"], timeout=60,
            resources={{"accelerators": "A100:1"}},
            command=["/bin/sh", "-c",
                     f'echo "$CUDA_VISIBLE_DEVICES" > {base}/seen-{{name}}; '
                     f'while [ ! -e {base}/gate-{{name}} ]; do sleep 0.05; done; '
                     f'echo {{name}} > fit-{{name}}.txt',
                     {marker!r}],
        )
"""
def test_two_one_gpu_steps_share_a_two_gpu_warm_cluster_and_a_cancel_stops_one_only(
    sky: Sky, marker: str
) -> None:
    """`accelerators = "A100:2"` for the cluster, "A100:1" for each step:
    two steps run side by side on one cluster, each given its own GPU by
    the worker; cancelling one stops its tree, the other goes on."""
    base = sky.base
    warm_project(sky, GPU_PAIR.format(base=str(base), marker=marker), sandbox="none",
                 accelerators="A100:2", python=two_gpu_python(base))  # fmt: skip
    proc = popen_doit(sky.root, "-n", "2", "-P", "thread", env=sky.env)
    try:
        seen = [base / "seen-a", base / "seen-b"]
        wait_for(lambda: all(p.exists() for p in seen), "both steps to run at once", timeout=90)
        (cancelled,) = [h for h in live_handles(sky.root) if h["step"] == "fit:b"]
        done = sky.compute("cancel", cancelled["run_id"])
        assert done.returncode == 0, done.stderr
        (base / "gate-a").touch()
        assert wait_exit(proc, "the doit to end", 180) != 0  # fit:b was cancelled
    finally:
        stop(proc)
    assert sorted(p.read_text().strip() for p in seen) == ["0", "1"]  # a GPU each
    assert (sky.root / "fit-a.txt").read_text() == "a\n" and not (sky.root / "fit-b.txt").exists()
    assert len(set(clusters_used(sky))) == 1 and len(sky.clusters()) == 1
    status = json.loads(sky.compute("status", cancelled["run_id"], "--json").stdout)
    assert status["runs"][0]["state"] == "cancelled", status
    assert marked_pids(marker) == []
