"""A cluster lost mid-run on the real one-node Slurm cluster of the test
bed, as a preemption looks there: the Slurm allocation that holds the
cluster is cancelled (`scancel` of its job) while the step counts. With
`preemptions=1` the step is relaunched on a new cluster from the last
snapshot of its checkpoints brought home, and finishes with the right
result; two attempts are recorded; the counts redone are at most those of
one `checkpoint_seconds` (plus the count under way): the command dies with
the allocation, so nothing is counted while the loss is detected.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
import time
from collections.abc import Callable

import pytest
from checkpoint_parts import COUNT_PY, count_step, counts, kept_state, result_of, starts
from dodo_helpers import HEADER

from e2e.conftest import SlurmBedInfo
from e2e.test_skypilot_e2e import (  # noqa: F401 - project_factory: a fixture
    LAUNCH_TIMEOUT,
    SkyProject,
    jobs_named,
    project_factory,
    report,
    wait_for,
)

pytestmark = pytest.mark.timeout(1800)  # two cold launches on the loaded bed, the bed's set-up first

COUNT_TO = 30
PAUSE = 1.0  # one count a second
EVERY = 3.0  # checkpoint_seconds


def allocation_of(project: SkyProject, cluster: str) -> str:
    """The Slurm job that holds the cluster: SkyPilot names it `<cluster>-<user hash>`."""
    (job,) = [job for job in jobs_named(project.bed, project.prefix) if job[1].startswith(f"{cluster}-")]
    return job[0]


def test_the_allocation_cancelled_mid_run_is_relaunched_and_the_step_finishes_from_its_snapshot(
    slurm_bed: SlurmBedInfo, project_factory: Callable[[str], SkyProject], request: pytest.FixtureRequest
) -> None:
    project = project_factory("sxe-pre")
    project.configure(lifetime_minutes=30, checkpoint_seconds=EVERY)
    body = "def task_all():\n" + count_step("count", COUNT_TO, PAUSE, preemptions=1, timeout=900)
    config = 'DOIT_CONFIG = doit_config(default_tasks=["count"])\n'
    (project.root / "dodo.py").write_text(HEADER + config + textwrap.dedent(body))
    (project.root / "count.py").write_text(COUNT_PY)
    (project.root / "data.txt").write_text("one\n")
    proc = project.popen_doit()
    started = time.monotonic()
    wait_for(lambda: (kept_state(project.root, "count") or {}).get("i", 0) >= 6 or proc.poll() is not None,
             "a snapshot of 6 counts brought home", LAUNCH_TIMEOUT, every=0.5)  # fmt: skip
    assert proc.poll() is None, project.output()
    time.sleep(EVERY / 2)  # between two snapshots, as a preemption comes at any time
    cluster = project.handle()["backend_state"]["cluster"]
    job = allocation_of(project, cluster)
    kept = (kept_state(project.root, "count") or {})["i"]
    subprocess.run(["scancel", job], env=slurm_bed.bed.slurm_env(), capture_output=True, timeout=60,
                   check=True)  # fmt: skip
    cancelled = time.monotonic()
    assert proc.wait(timeout=LAUNCH_TIMEOUT) == 0, project.output()
    said = project.output()
    reached, seen = result_of(project.root, "count")
    # each count once in the history the checkpoint carries: the second attempt went on from the snapshot's
    assert (reached, seen) == (COUNT_TO, list(range(1, COUNT_TO + 1))), said
    first, second = project.handle()["state"]["attempts"]
    assert (first["outcome"], first["machine"]) == ("lost", cluster), first
    assert (second["outcome"], second["snapshot"] is not None) == ("succeeded", True), second
    assert second["machine"] != cluster
    # The counts the first attempt was seen to make (its log, followed here until the allocation
    # ended), then the second's: the counts redone are those past the snapshot it started from.
    second_start = [m.start() for m in re.finditer(r"^start \d+$", said, re.M)][1]
    at_loss = max(counts(said[:second_start]))
    fresh, resumed = starts(said)
    assert fresh == 0 and kept <= resumed <= at_loss, said  # from the latest snapshot brought home
    redone = at_loss - resumed
    # One checkpoint_seconds of counts, the count under way, and one for the snapshot's own copy
    assert redone <= EVERY / PAUSE + 2, f"{redone} counts redone\n{said}"
    assert counts(said[second_start:]) == list(range(resumed + 1, COUNT_TO + 1)), said
    project.assert_gone(cluster)
    report(request, "preemption", {"to_loss": cancelled - started, "after_loss": time.monotonic() - cancelled,
                                   "redone": float(redone)})  # fmt: skip
