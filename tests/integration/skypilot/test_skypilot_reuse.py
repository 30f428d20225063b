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
from pathlib import Path

from dodo_helpers import (
    doit,
    doit_ok,
    run_count,
    show,
    step_skipped,
)
from sky_beds import Sky
from ssh_helpers import needs_root, needs_sshd, write_ssh_dodo

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
