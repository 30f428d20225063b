"""SkyPilot clusters reused across steps (`reuse = true`), through the real
`doit` and helper against the fake SkyPilot, with the clusters' ssh served
by a real sshd in a network namespace: steps take turns on a cluster
through its lease (remote/lease.py), the worker started over ssh. Warm
clusters across doits, their lease and lifetime: test_skypilot_warm.py."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
from pathlib import Path

from dodo_helpers import (
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
from progress import wait_exit
from sky_beds import Sky
from ssh_helpers import compute_in_view, needs_root, needs_sshd, popen_doit_in_view, write_ssh_dodo

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


def test_a_threaded_sweep_takes_turns_on_at_most_max_parallel_clusters_left_warm(sky: Sky) -> None:
    sweep(sky, steps=6, timeout=60, max_parallel=2)
    done = doit(sky.root, "-n", "4", "-P", "thread", env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    for m in range(6):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"hello\nm{m}\n"
    used = clusters_used(sky)
    assert len(used) == 6 and len(set(used)) == 2, used  # two launched, four run on them in turn
    assert done.stdout.count("launching cluster") == 2, show(done)
    assert done.stdout.count("on warm cluster") == 4, show(done)
    assert "waits for a free slot on SkyPilot (cpus=1) (2 running)" in done.stdout, show(done)
    assert sorted(sky.clusters()) == sorted(set(used))  # doit ending left them warm
    status = sky.compute("status", "--all", "--json")
    assert {r["state"] for r in json.loads(status.stdout)["runs"]} == {"succeeded"}, status.stdout
    asked = sky.requests()
    again = doit_ok(sky.root, "-n", "4", "-P", "thread", env=sky.env)
    assert all(step_skipped(again, f"fit:m{m}") for m in range(6)), show(again)
    assert sky.requests() == asked and run_count(sky.root) == 6


def test_a_cluster_without_lifetime_left_for_the_timeout_is_replaced_not_reused(sky: Sky) -> None:
    # 9 minutes of lifetime (10 less SkyPilot's 1-minute autodown): a timeout of 8 leaves
    # less than the margin.
    sweep(sky, steps=2, timeout=480, max_parallel=1)
    done = doit(sky.root, env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    first, second = clusters_used(sky)
    assert first != second, show(done)
    assert f"not reusing cluster {first} (" in done.stdout and "too few for the step's timeout" in done.stdout
    assert sky.clusters() == [second]  # the first taken down, the second left warm


def test_steps_on_a_warm_cluster_reach_the_home_its_lease_runs_in(sky: Sky) -> None:
    """The default, relative remote_root, on a cluster whose ssh starts
    outside the jobs' home (see test_skypilot_chain): every step's files go,
    and its outputs are fetched, where the lease's job printed its home.
    Each warm run records the lifetime it armed: the cluster's, counted
    from its launch."""
    sweep(sky, steps=3, timeout=60, max_parallel=1)
    sky.configure(reuse=True, max_parallel=1, remote_root=".substrax-remote")
    done = doit(sky.root, env=sky.env, timeout=300)
    assert done.returncode == 0, show(done)
    for m in range(3):
        assert (sky.root / f"fit-{m}.txt").read_text() == f"hello\nm{m}\n"
    assert done.stdout.count("on warm cluster") == 2, show(done)
    runs = sky.root / ".substrax" / "runs"
    handles = [json.loads(p.read_text()) for p in sorted(runs.glob("*/handle.json"))]
    (cluster,) = {h["backend_state"]["cluster"] for h in handles}
    home = sky.home / ".fakesky" / "clusters" / cluster / "home"
    assert {h["backend_state"]["job_home"] for h in handles} == {str(home.resolve())}, show(done)
    launched = next(h for h in handles if h["step"] == "fit:m0")["backend_state"]["watchdog"]
    for h in handles:
        timer = h["backend_state"]["watchdog"]
        assert timer["armed_at"] + timer["seconds"] <= launched["armed_at"] + launched["seconds"] + 1e-3
    assert sky.clusters() == [cluster]
    # learnt once from the lease's log, then kept with the warm cluster for its next steps
    (record,) = (sky.root / ".substrax" / "slots").glob("skypilot-*/0.json")
    assert json.loads(record.read_text())["job_home"] == str(home.resolve())


def test_a_cluster_setup_leaves_the_job_home_files_of_other_clusters_alone(sky: Sky) -> None:
    """A relative remote_root's job-home files sit in the login's home,
    which on a Slurm site every node and every client shares: a new
    cluster's setup writes its own file there and removes none of the
    others' (another setup's write in progress, a home on another node
    that is not a folder here)."""
    root = f".substrax-remote-{secrets.token_hex(4)}"  # its own: other tests' leases write beside theirs
    sweep(sky, steps=1, timeout=60, max_parallel=1)
    sky.configure(reuse=True, max_parallel=1, remote_root=root)
    homes = Path(pwd.getpwuid(os.getuid()).pw_dir) / root / "job-homes"
    homes.mkdir(parents=True)
    try:
        on_another_node = homes / "sky-other-node-cluster"
        on_another_node.write_text("/scratch/node17/sky-other-node-cluster\n")
        being_written = homes / "sky-other-setup.4242.tmp"
        being_written.write_text("")
        done = doit(sky.root, env=sky.env, timeout=300)
        assert done.returncode == 0, show(done)
        assert (sky.root / "fit-0.txt").read_text() == "hello\nm0\n"
        assert on_another_node.read_text() == "/scratch/node17/sky-other-node-cluster\n"
        assert being_written.exists()
    finally:
        shutil.rmtree(homes.parent)


# Four steps; each appends "start"/"end" to one file around its wait for
# the gate (the file's order is the order the commands started and ended
# in). Unsandboxed: the stamps and the gate are outside the project.
GATED_SWEEP = """
def task_fit():
    for m in range(4):
        yield from remote_step(
            f"fit:m{{m}}", outputs=[f"out-{{m}}.txt"], timeout=60, resources={{"cpus": 1}},
            command=["/bin/sh", "-c", f"echo start >> {stamps}; while [ ! -e {gate} ]; do sleep 0.05; done; "
                     f"echo end >> {stamps}; echo {{m}} > out-{{m}}.txt"],
        )
"""


def most_at_once(stamps: Path) -> int:
    running = most = 0
    for line in stamps.read_text().splitlines():
        running += 1 if line == "start" else -1
        most = max(most, running)
    return most


def test_after_kill_9_of_doit_the_rerun_keeps_max_parallel_on_the_warm_clusters(sky: Sky) -> None:
    """reuse = true, max_parallel = 2, four steps under `doit -n 4 -P
    thread`: doit is killed with SIGKILL while two run on their clusters
    and two wait. The rerun reattaches to the two that run (they hold their
    slots, and so their clusters, though no client did), the other two
    wait for them and then take turns on the same two clusters: never more
    than two commands or two clusters at once."""
    stamps, gate = sky.base / "stamps.txt", sky.base / "gate"
    stamps.touch()
    sky.configure(reuse=True, max_parallel=2, idle_minutes=60, sandbox="none")
    write_ssh_dodo(sky.root, GATED_SWEEP.format(stamps=stamps, gate=gate), ["fit"])
    first = popen_doit(sky.root, "-n", "4", "-P", "thread", env=sky.env)
    again = None
    try:
        wait_for(lambda: stamps.read_text().count("start") == 2 and popen_output(sky.root).count(
            "waits for a free slot") == 2, "two steps to run and two to wait", timeout=180)  # fmt: skip
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        running = sorted(sky.clusters())
        assert len(running) == 2, running
        again = popen_doit(sky.root, "-n", "4", "-P", "thread", env=sky.env)
        wait_for(lambda: popen_output(sky.root).count("waits for a free slot") == 2
                 or stamps.read_text().count("start") > 2, "the rerun's slots", timeout=180)  # fmt: skip
        gate.touch()
        assert wait_exit(again, "the doit to end", 300) == 0, popen_output(sky.root)
    finally:
        gate.touch()
        stop(first)
        if again is not None:
            stop(again)
    assert most_at_once(stamps) <= 2, stamps.read_text()
    assert stamps.read_text().count("end") == 4, stamps.read_text()
    for m in range(4):
        assert (sky.root / f"out-{m}.txt").read_text() == f"{m}\n"
    assert sorted(set(clusters_used(sky))) == running == sorted(sky.clusters()), popen_output(sky.root)


def test_gc_machines_of_a_client_at_the_same_project_path_leaves_anothers_warm_cluster(sky: Sky) -> None:
    """Two clients at one project path (each its folder bind-mounted there,
    as CI jobs and containers are), each leaving a warm cluster: the
    second's `gc --machines` takes its own down (its id names it) and
    leaves the first's, which the first's next doit finds warm."""
    sweep(sky, steps=1, timeout=60, max_parallel=1)
    at = sky.base / "workspace"
    at.mkdir()
    second = sky.base / "two" / "proj"
    shutil.copytree(sky.root, second)
    (second / "data" / "in.txt").write_text("the second's\n")  # not a hit in the first's run cache
    for root in (sky.root, second):
        assert popen_doit_in_view(root, at, env=sky.env).wait(timeout=300) == 0
    (first_cluster,) = set(clusters_used(sky))
    (second_cluster,) = {json.loads(p.read_text())["backend_state"]["cluster"]
                         for p in (second / ".substrax" / "runs").glob("*/handle.json")}  # fmt: skip
    assert sorted(sky.clusters()) == sorted([first_cluster, second_cluster])
    listed = json.loads(compute_in_view(second, at, "status", "--machines", "--json", env=sky.env).stdout)
    leaked = {(m["name"], m["ours"]) for m in listed["leaked"]}
    assert leaked == {(first_cluster, False), (second_cluster, True)}, listed
    done = compute_in_view(second, at, "gc", "--machines", env=sky.env)
    assert done.returncode == 0, show(done)
    assert sky.clusters() == [first_cluster], show(done)
    (sky.root / "data" / "in.txt").write_text("edit\n")
    assert popen_doit_in_view(sky.root, at, env=sky.env).wait(timeout=300) == 0
    assert clusters_used(sky) == [first_cluster, first_cluster]  # warm still: its second step ran on it
