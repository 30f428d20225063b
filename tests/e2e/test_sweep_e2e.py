"""A sweep on the real one-node Slurm cluster of the test bed, with
`reuse = true` and `max_parallel = 2`: four steps under `doit -n 4 -P
thread` take turns on at most two clusters (each held by its lease, every
step run by the worker over ssh), every output is verified here; a new
`doit` after an edit runs every step on the clusters the first left warm,
with no launch; `gc --machines` then takes them down.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
from collections.abc import Callable

import pytest
from dodo_helpers import DOIT, HEADER, run_count, show, step_skipped

from e2e.conftest import SlurmBedInfo
from e2e.test_skypilot_e2e import (  # noqa: F401 - project_factory: a fixture
    LAUNCH_TIMEOUT,
    SkyProject,
    api_requests,
    jobs_named,
    project_factory,
    wait_for,
)

pytestmark = pytest.mark.timeout(1800)  # two launches, four jobs, two downs; the bed's set-up first

SWEEP = """
def task_fit():
    for m in range(4):
        yield from remote_step(
            f"fit:m{m}", inputs=["data/in.txt"], outputs=[f"fit-{m}.txt"], timeout=120,
            shell=f"cat data/in.txt > fit-{m}.txt; echo m{m} >> fit-{m}.txt",
        )
"""


def test_a_sweep_with_reuse_takes_turns_on_two_clusters_that_the_next_doit_finds_warm(
    slurm_bed: SlurmBedInfo,
    project_factory: Callable[[str], SkyProject],
) -> None:
    project = project_factory("sxe-sw")
    # 30 minutes of lifetime: a first launch on a fresh bed (its runtime install) takes several
    project.configure(reuse=True, max_parallel=2, lifetime_minutes=30)
    config = 'DOIT_CONFIG = doit_config(default_tasks=["fit"])\n'
    (project.root / "dodo.py").write_text(HEADER + config + textwrap.dedent(SWEEP))
    (project.root / "data").mkdir()
    (project.root / "data" / "in.txt").write_text("hello\n")
    with (project.root.parent / "doit.out").open("w") as out:
        proc = subprocess.Popen(
            [str(DOIT), "-n", "4", "-P", "thread"], cwd=project.root, env=project.env,
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    project.procs.append(proc)
    most = 0  # the most clusters (Slurm jobs of this project's prefix) seen at once
    started = time.monotonic()
    while proc.poll() is None and time.monotonic() - started < LAUNCH_TIMEOUT:
        most = max(most, len(jobs_named(slurm_bed, project.prefix)))
        time.sleep(2)
    said = project.output()
    assert proc.wait(timeout=60) == 0, said
    assert most <= 2, f"{most} clusters at once\n{said}"
    for m in range(4):
        assert (project.root / f"fit-{m}.txt").read_text() == f"hello\nm{m}\n"
    assert said.count("launching cluster") <= 2 and said.count("on warm cluster") >= 2, said
    warm = project.clusters()  # doit ended; its clusters stay warm, held by their leases
    assert 1 <= len(warm) <= 2, said
    (project.root / "data" / "in.txt").write_text("edited\n")  # the loop: edit, doit again
    again = project.doit("-n", "4", "-P", "thread")
    assert again.returncode == 0, show(again)
    assert "launching cluster" not in again.stdout and again.stdout.count("on warm cluster") == 4, show(again)
    for m in range(4):
        assert (project.root / f"fit-{m}.txt").read_text() == f"edited\nm{m}\n"
    gc = project.compute("gc", "--machines")
    assert gc.returncode == 0, show(gc)
    assert project.clusters() == [], show(gc)
    wait_for(lambda: jobs_named(slurm_bed, project.prefix) == [], "the clusters' Slurm jobs to end", 60)
    asked = api_requests(slurm_bed)
    noop = project.doit("-n", "4", "-P", "thread")
    assert noop.returncode == 0, show(noop)
    assert all(step_skipped(noop, f"fit:m{m}") for m in range(4)), show(noop)
    assert api_requests(slurm_bed) == asked and run_count(project.root) == 8
