"""A damaged record of a warm cluster's life (`.substrax/machines/CLUSTER.json`,
store/shared_machine.py; issue 28, item 9): the costs of the runs that used
the cluster read as not known rather than wrong, `status` and `report` show
every run without a traceback, and the next step on the warm cluster goes
on: the damaged record is moved aside, kept, and said. The real `doit` and
`substrax-compute`, the fake SkyPilot, the cluster's ssh a real sshd."""

from __future__ import annotations

import json

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


def test_a_damaged_life_of_a_warm_cluster_reads_as_cost_not_known_and_the_next_step_goes_on(
    sky: Sky,
) -> None:
    sky.project()
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60, infra="aws", instance_type="m6i.large")
    write_ssh_dodo(sky.root, WARM, ["fit"])
    first = doit(sky.root, env=sky.env, timeout=180)
    assert first.returncode == 0 and "launching cluster" in first.stdout, show(first)
    [cluster] = sky.clusters()
    life = sky.root / ".substrax" / "machines" / f"{cluster}.json"
    damaged = life.read_text()[:25]
    life.write_text(damaged)

    listed = sky.compute("status", "--all", "--json")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    (cold,) = json.loads(listed.stdout)["runs"]
    assert cold["cost_usd"] is None, cold  # not known; before: the run's own times, as if not shared
    table = sky.compute("status", "--all")
    assert table.returncode == 0, table.stderr
    said = (f"its cost is not known: its machine record is damaged (the record of the machine it used "
            f"in turn with other runs, {life}, is missing, damaged, or begun anew without it)")
    assert said in table.stderr, table.stderr

    (sky.root / "data" / "in.txt").write_text("edit\n")
    again = doit(sky.root, env=sky.env, timeout=180)
    assert again.returncode == 0 and "on warm cluster" in again.stdout, show(again)
    (aside,) = life.parent.glob(f"{life.name}.damaged-*")
    assert aside.read_text() == damaged  # kept as it was
    assert f"moved aside to {aside}" in again.stdout + again.stderr, show(again)
    assert (sky.root / "fit.txt").read_text() == "edit\n"
    listed = sky.compute("status", "--all", "--json")
    assert listed.returncode == 0, listed.stderr
    cold, warm = sorted(json.loads(listed.stdout)["runs"], key=lambda run: str(run["created_at"]))
    assert cold["cost_usd"] is None, cold  # the life it was charged from is gone: not known
    # A new record of the cluster's life began at the warm run's claim: its piece is known again.
    assert warm["cost_usd"] > 0 and warm["cost_projected"] is True, warm
    report = sky.compute("report", "--all", "-o", str(sky.base / "report.html"))
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr
    gone = sky.compute("gc", "--machines")
    assert gone.returncode == 0 and "Traceback" not in gone.stderr, gone.stderr
    assert sky.clusters() == []
