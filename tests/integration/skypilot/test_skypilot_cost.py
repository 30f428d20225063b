"""A SkyPilot run's cost at its catalog price, and its `max_cost` cap:
through the real `doit` and `substrax-compute`, the real sky_sdk.py helper
and the fake SkyPilot, whose catalog prices a few instance types as
SkyPilot's does (tests/support/fakesky/sky/clouds.py), with the cluster's
ssh served by a real sshd in a network namespace."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from dodo_helpers import doit, show
from sky_beds import COMMAND, Sky, two_gpu_python
from ssh_helpers import needs_root, needs_sshd, only_handle, write_ssh_dodo

pytestmark = [needs_sshd, needs_root]

CAPPED = """
def task_step():
    yield from remote_step(
        "step", shell=COMMAND, inputs=["data/in.txt"], outputs=["out/", "res.txt"], max_cost={cap!r},
    )
"""


def capped_project(sky: Sky, cap: float, command: str = COMMAND, **settings: Any) -> None:
    sky.project()
    sky.configure(**settings)
    write_ssh_dodo(sky.root, f"COMMAND = {command!r}\n" + CAPPED.format(cap=cap), ["step"])


def status_runs(sky: Sky) -> list[dict[str, Any]]:
    done = sky.compute("status", "--json")
    assert done.returncode == 0, done.stderr
    runs: list[dict[str, Any]] = json.loads(done.stdout)["runs"]
    return runs


def test_a_runs_cost_is_its_machine_time_at_the_catalog_price_of_what_was_launched(sky: Sky) -> None:
    sky.project()
    sky.configure(infra="aws", instance_type="m6i.large")  # $0.096 an hour in the catalog
    done = doit(sky.root, env=sky.env, timeout=180)
    assert done.returncode == 0, show(done)
    # No cap: nothing asked of SkyPilot before the launch; the price is said as launched.
    said = "step: $0.0960/h on skypilot; at most $0.0160 over its machine's lifetime of 10:00 (as launched)"
    assert said in done.stdout, show(done)
    [run] = status_runs(sky)
    assert run["hourly_cost"] == pytest.approx(0.096)
    # From the launch request to the cluster's teardown, all of it at that price.
    assert run["machine_seconds"] > 0, run
    assert run["cost_usd"] == pytest.approx(run["machine_seconds"] * 0.096 / 3600)
    assert only_handle(sky.root)["state"]["cost_usd"] == pytest.approx(run["cost_usd"])
    assert sky.clusters() == []
    table = sky.compute("status")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split()[-1] == "cost", table.stdout
    assert row.split()[-1] == f"${run['cost_usd']:.4f}", table.stdout


def test_a_cap_on_resources_the_catalog_cannot_price_launches_nothing(sky: Sky) -> None:
    # No instance type: SkyPilot's catalog prices nothing before its optimizer has chosen one.
    capped_project(sky, 1.0, infra="aws")
    done = doit(sky.root, env=sky.env, timeout=180)
    assert done.returncode == 1, show(done)
    said = done.stdout + done.stderr
    assert "max_cost = $1.0000 cannot be kept" in said, show(done)
    assert "set hourly_cost" in said and "[tool.substrax.compute.backends.skypilot]" in said, show(done)
    assert sky.requests() == 0 and sky.clusters() == []  # not a request made, not a cluster
    [run] = status_runs(sky)
    assert run["state"] == "failed" and "cannot be kept" in run["message"], run


def test_hourly_cost_prices_what_the_catalog_cannot_and_overrides_it(sky: Sky) -> None:
    capped_project(sky, 1.0, infra="aws", hourly_cost=2.5)
    done = doit(sky.root, env=sky.env, timeout=180)
    assert done.returncode == 0, show(done)
    assert "step: $2.5000/h on skypilot (hourly_cost)" in done.stdout, show(done)
    [run] = status_runs(sky)
    assert run["hourly_cost"] == 2.5 and run["max_cost"] == 1.0, run


def test_a_cap_reached_mid_run_stops_the_run_and_takes_the_cluster_down(sky: Sky) -> None:
    # p3.2xlarge is $3.06 an hour: $0.02 lasts about 24 s from the launch.
    capped_project(sky, 0.02, command="echo started; sleep 600", sandbox="none", infra="aws",
                   instance_type="p3.2xlarge")  # fmt: skip
    done = doit(sky.root, env=sky.env, timeout=240)
    assert done.returncode == 1, show(done)
    worst = "step: $3.0600/h on skypilot; at most $0.5100 over its machine's lifetime of 10:00"
    assert worst in done.stdout, show(done)
    said = done.stdout + done.stderr
    assert "its cost reached max_cost = $0.0200" in said, show(done)
    assert "started" in said, show(done)  # it was stopped mid-run, not before
    assert sky.clusters() == []  # taken down
    handle = only_handle(sky.root)
    assert handle["state"]["verdict"]["state"] == "failed"
    assert "max_cost = $0.0200" in handle["state"]["verdict"]["message"]
    [run] = status_runs(sky)
    assert run["state"] == "failed" and "max_cost" in run["message"], run
    # The cap, plus the seconds the stop and the teardown took at $3.06 an hour.
    assert 0.02 <= run["cost_usd"] < 0.02 + 0.03, run


WARM = """
def task_fit():
    yield from remote_step(
        "fit", inputs=["data/in.txt"], outputs=["fit.txt"], timeout=60, resources={"cpus": 1},
        shell="cat data/in.txt > fit.txt",
    )
"""


def test_a_step_on_a_warm_cluster_is_priced_as_the_cluster_was_launched(sky: Sky) -> None:
    sky.project()
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60, infra="aws", instance_type="m6i.large")
    write_ssh_dodo(sky.root, WARM, ["fit"])
    first = doit(sky.root, env=sky.env, timeout=180)
    assert first.returncode == 0 and "launching cluster" in first.stdout, show(first)
    (sky.root / "data" / "in.txt").write_text("edit\n")
    again = doit(sky.root, env=sky.env, timeout=180)
    assert again.returncode == 0 and "on warm cluster" in again.stdout, show(again)
    # The warm step's price is the cluster's, as its launch priced it: said before, asked of no one.
    before_the_claim = again.stdout.split("on warm cluster")[0]
    assert "fit: $0.0960/h on skypilot" in before_the_claim, show(again)
    assert "(as launched)" not in again.stdout, show(again)
    done = sky.compute("status", "--all", "--json")
    assert done.returncode == 0, done.stderr
    cold, warm = json.loads(done.stdout)["runs"]
    assert cold["hourly_cost"] == warm["hourly_cost"] == pytest.approx(0.096), (cold, warm)
    assert warm["cost_usd"] == pytest.approx(warm["machine_seconds"] * 0.096 / 3600)
    gone = sky.compute("gc", "--machines")
    assert gone.returncode == 0, gone.stderr
    assert sky.clusters() == []


def cluster_life(sky: Sky, cluster: str) -> dict[str, Any]:
    """The client's record of a warm cluster's life: its launch, each run's claim, its end."""
    path = sky.root / ".substrax" / "machines" / f"{cluster}.json"
    life: dict[str, Any] = json.loads(path.read_text())
    return life


def test_a_warm_clusters_whole_life_is_shared_out_among_the_runs_that_used_it(sky: Sky) -> None:
    sky.project()
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"
    sky.configure(reuse=True, max_parallel=1, idle_minutes=60, infra="aws", instance_type="m6i.large")
    write_ssh_dodo(sky.root, WARM, ["fit"])
    before = time.time()
    first = doit(sky.root, env=sky.env, timeout=180)
    assert first.returncode == 0 and "launching cluster" in first.stdout, show(first)
    # The worst case said before the launch counts the keep-warm the last run pays.
    worst = "at most $0.0976 over its timeout of 1:00 and its keep-warm of 1:00:00"
    assert worst in first.stdout, show(first)
    time.sleep(3)  # the cluster waits warm: the first run's to pay, up to the next claim
    (sky.root / "data" / "in.txt").write_text("edit\n")
    again = doit(sky.root, env=sky.env, timeout=180)
    assert again.returncode == 0 and "on warm cluster" in again.stdout, show(again)
    [cluster] = sky.clusters()
    life = cluster_life(sky, cluster)
    launch, claim = life["claims"][0]["at"], life["claims"][1]["at"]
    assert before <= launch and claim - launch > 3, life
    cold, warm = status_runs_all(sky)
    # The first run: from the launch to the second run's claim, the wait between them included.
    assert cold["machine_seconds"] == pytest.approx(claim - launch)
    assert cold["cost_usd"] == pytest.approx((claim - launch) * 0.096 / 3600) and not cold["cost_projected"]
    # The last one: from its claim to the end of the keep-warm its release began, until the cluster is gone.
    released = life["released"][warm["run_id"]]
    assert warm["cost_projected"] is True, warm
    assert warm["machine_seconds"] == pytest.approx(released + 3600 - claim)
    table = sky.compute("status", "--all")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[2].split()[-1] == f"~${warm['cost_usd']:.4f}", table.stdout
    gone = sky.compute("gc", "--machines")
    assert gone.returncode == 0, gone.stderr
    after = time.time()
    assert sky.clusters() == []
    down = cluster_life(sky, cluster)["down_at"]
    assert released < down < after, cluster_life(sky, cluster)
    cold, warm = status_runs_all(sky)
    assert warm["cost_projected"] is False and warm["machine_seconds"] == pytest.approx(down - claim)
    # No gap, no overlap: the two runs together paid for the cluster's whole life, and no more.
    assert cold["machine_seconds"] + warm["machine_seconds"] == pytest.approx(down - launch)
    assert cold["cost_usd"] + warm["cost_usd"] == pytest.approx((down - launch) * 0.096 / 3600)
    assert down - launch < after - before


def status_runs_all(sky: Sky) -> list[dict[str, Any]]:
    done = sky.compute("status", "--all", "--json")
    assert done.returncode == 0, done.stderr
    runs: list[dict[str, Any]] = json.loads(done.stdout)["runs"]
    return sorted(runs, key=lambda r: str(r["created_at"]))


def test_a_capped_step_on_a_warm_cluster_keeps_its_keep_warm_back_from_its_budget(sky: Sky) -> None:
    # p3.2xlarge is $3.06 an hour: the 2 min of keep-warm after the run cost $0.102 of its $0.15,
    # so the command is stopped once the run has spent about $0.048, not $0.15.
    capped_project(sky, 0.15, command="echo started; sleep 600", sandbox="none", infra="aws",
                   instance_type="p3.2xlarge", reuse=True, max_parallel=1, idle_minutes=2)  # fmt: skip
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"
    done = doit(sky.root, env=sky.env, timeout=240)
    assert done.returncode == 1, show(done)
    # Its worst case counts the keep-warm too: $3.06 an hour over 10 + 2 min.
    worst = "at most $0.6120 over its machine's lifetime of 10:00 and its keep-warm of 2:00"
    assert worst in done.stdout, show(done)
    said = done.stdout + done.stderr
    assert "its cost reached max_cost = $0.1500" in said and "started" in said, show(done)
    [run] = status_runs(sky)
    assert run["state"] == "failed" and run["cost_projected"] is True, run
    # What it spent and the keep-warm it pays, within the cap but for the seconds the stop took.
    assert 0.15 <= run["cost_usd"] < 0.15 + 0.03, run
    gone = sky.compute("gc", "--machines")
    assert gone.returncode == 0, gone.stderr
    assert sky.clusters() == []


PAIR = """
def task_fit():
    for name in ("a", "b"):
        yield from remote_step(
            f"fit:{name}", outputs=[f"fit-{name}.txt"], timeout=60, resources={"accelerators": "A100:1"},
            shell=f"echo {name} > fit-{name}.txt",
        )
"""


def test_steps_side_by_side_on_a_warm_cluster_each_pay_their_seats_share_of_its_life(sky: Sky) -> None:
    # "A100:2" shared out as "A100:1": two seats at $1.00 an hour each of the cluster's $2.00.
    sky.project()
    sky.env["FAKESKY_MINUTE_SECONDS"] = "2"
    sky.configure(reuse=True, max_parallel=2, idle_minutes=60, accelerators="A100:2", hourly_cost=2.0,
                  sandbox="none", python=two_gpu_python(sky.base))  # fmt: skip
    write_ssh_dodo(sky.root, PAIR, ["fit"])
    done = doit(sky.root, "-n", "2", "-P", "thread", env=sky.env, timeout=180)
    assert done.returncode == 0, show(done)
    [cluster] = sky.clusters()
    gone = sky.compute("gc", "--machines")
    assert gone.returncode == 0, gone.stderr
    assert sky.clusters() == []
    life = cluster_life(sky, cluster)
    whole = life["down_at"] - life["claims"][0]["at"]
    assert sorted(c["seat"] for c in life["claims"]) == [0, 1], life
    a, b = status_runs_all(sky)
    # Each the first in its seat: from the launch to the cluster going, at its seat's share.
    for run in (a, b):
        assert run["hourly_cost"] == pytest.approx(1.0) and not run["cost_projected"], run
        assert run["machine_seconds"] == pytest.approx(whole), (run, life)
    assert a["cost_usd"] + b["cost_usd"] == pytest.approx(whole * 2.0 / 3600)
