"""A damaged slot record of a warm SkyPilot cluster (`.substrax/slots/skypilot-*/N.json`,
issue 28, item 9, over the records added since): a field of the wrong type
made the next step of the slot, and `status --machines`, end in a
traceback. The record is moved aside, kept and said; the step launches a
cluster of its own in the slot, and the one the record named, still warm,
is shown by `status --machines` and taken down by `gc --machines`. The
real `doit` and `substrax-compute`, the fake SkyPilot, the cluster's ssh
a real sshd."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from dodo_helpers import doit, show
from sky_beds import Sky
from ssh_helpers import needs_root, needs_sshd, write_ssh_dodo

pytestmark = [needs_sshd, needs_root]

WARM = """
def task_fit():
    yield from remote_step(
        "fit", inputs=["data/in.txt"], outputs=["fit.txt"], timeout=60, resources={"cpus": 1},
        shell="cat data/in.txt > fit.txt",
    )
"""
DAMAGES = [
    pytest.param(lambda r: {**r, "deadline": "soon"}, id="deadline"),
    pytest.param(lambda r: {**r, "hourly_cost": "0.096"}, id="hourly-cost"),
    pytest.param(lambda r: {**r, "job_home": 5}, id="job-home"),
    pytest.param(lambda r: [r], id="not-a-record"),
]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_slot_record_is_moved_aside_and_the_next_step_launches_its_own_cluster(
    sky: Sky, damage: Callable[[dict[str, Any]], Any]
) -> None:
    sky.project()
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60, infra="aws", instance_type="m6i.large")
    write_ssh_dodo(sky.root, WARM, ["fit"])
    first = doit(sky.root, env=sky.env, timeout=180)
    assert first.returncode == 0 and "launching cluster" in first.stdout, show(first)
    [warm] = sky.clusters()
    (slot,) = (sky.root / ".substrax" / "slots").glob("skypilot-*/*.json")
    damaged = json.dumps(damage(json.loads(slot.read_text())))
    slot.write_text(damaged)

    (sky.root / "data" / "in.txt").write_text("edit\n")
    again = doit(sky.root, env=sky.env, timeout=180)
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "Traceback" not in said, show(again)
    (aside,) = slot.parent.glob(f"{slot.name}.damaged-*")
    assert aside.read_text() == damaged  # kept as it was
    assert f"{slot} was damaged" in said and f"moved aside to {aside}" in said, show(again)
    assert "launching cluster" in again.stdout and (sky.root / "fit.txt").read_text() == "edit\n", show(again)

    shown = sky.compute("status", "--machines")
    assert "Traceback" not in shown.stderr and warm in shown.stderr, shown.stdout + shown.stderr
    gone = sky.compute("gc", "--machines")
    assert gone.returncode == 0 and "Traceback" not in gone.stderr, gone.stdout + gone.stderr
    assert sky.clusters() == []
