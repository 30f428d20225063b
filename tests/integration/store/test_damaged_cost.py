"""A damaged cost record (issue 28, item 9, over the records added since):
the machine record a run keeps in its handle (its time, price and cap,
store/cost.py), its attempts. `status` (and `--json`), `report`, `why`,
`gc` and `doit` never end in a traceback; the run's cost reads as not known
rather than wrong, the other runs show as they are, and a damaged record
never lets a running step spend past its max_cost: what it spent is not
known, so its cap is taken as spent (docs/cost.md).

Real doit and `substrax-compute`, real workers on this machine, priced with
`hourly_cost`; the record is damaged by hand, under the handle's lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from checkpoint_parts import COUNT_PY, count_step
from dodo_helpers import (
    compute,
    doit,
    make_project,
    popen_doit,
    popen_output,
    runs_of,
    show,
    stop,
    wait_for,
    write_pyproject,
)
from filelock import FileLock
from progress import wait_exit

PRICED = "hourly_cost = 3.6\nmax_cost = 5.0\n"
THREE_STEPS = "".join(f"""
def task_{name}():
    yield from remote_step("{name}", inputs=["data.txt"], outputs=["{name}.txt"],
                           command=["sh", "-c", "cp data.txt {name}.txt"])
""" for name in "abc")


def damage_machine(root: Path, run_id: str, damage: Callable[[dict[str, Any]], Any]) -> None:
    """The run's machine record as `damage` makes it, written as the store does: under the handle's lock."""
    path = root / ".substrax" / "runs" / run_id / "handle.json"
    with FileLock(str(path.with_name("handle.lock"))):
        handle = json.loads(path.read_text())
        handle["state"]["machine"] = damage(handle["state"]["machine"])
        path.write_text(json.dumps(handle))


DAMAGES = [
    pytest.param(lambda m: {**m, "earlier": [{}]}, "earlier holds {}, not a machine", id="earlier-empty"),
    pytest.param(lambda m: {**m, "earlier": [{"asked_at": "x", "released_at": 1.0}]},
                 "earlier holds {'asked_at': 'x', 'released_at': 1.0}, not a machine",
                 id="earlier-wrong-type"),
    pytest.param(lambda m: {**m, "released_at": "soon"}, "released_at = 'soon', not a time",
                 id="released-at"),
    pytest.param(lambda m: {**m, "max_cost": "5"}, "max_cost = '5', not a number of USD", id="max-cost"),
]  # fmt: skip


@pytest.mark.parametrize(("damage", "said"), DAMAGES)
def test_a_damaged_cost_record_reads_as_unknown_and_every_reader_shows_the_other_runs(
    tmp_path: Path, damage: Callable[[dict[str, Any]], Any], said: str
) -> None:
    root = make_project(tmp_path, THREE_STEPS, default_tasks=["a", "b", "c"], files={"data.txt": "one\n"})
    write_pyproject(root, extra=PRICED)
    first = doit(root)
    assert first.returncode == 0, show(first)
    (a_run,) = runs_of(root, "a")
    damage_machine(root, a_run["run_id"], damage)

    listed = compute(root, "status", "--all")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, show(listed)
    rows = {line.split()[1]: line.split()[-1] for line in listed.stdout.splitlines()[1:]}
    assert rows["a"] == "-/$5.0000", show(listed)  # not known, under its cap as it was pinned
    assert all(rows[step].startswith("$0.0") and rows[step].endswith("/$5.0000") for step in "bc"), rows
    told = f"run {a_run['run_id']}: its cost is not known: its machine record is damaged ({said})"
    assert told in listed.stderr, show(listed)

    as_json = compute(root, "status", "--all", "--json")
    assert as_json.returncode == 0, show(as_json)
    runs = {run["step"]: run for run in json.loads(as_json.stdout)["runs"]}
    assert (runs["a"]["cost_usd"], runs["a"]["max_cost"]) == (None, 5.0), runs["a"]
    assert runs["b"]["cost_usd"] > 0 and runs["c"]["cost_usd"] > 0, runs

    report = compute(root, "report", "--all", "-o", str(tmp_path / "report.html"))
    assert report.returncode == 0 and "Traceback" not in report.stderr, show(report)
    page = (tmp_path / "report.html").read_text()
    assert all(run["run_id"] in page for run in runs.values()), "a run is missing from the report"
    for argv in (["why", "a"], ["gc"]):
        done = compute(root, *argv)
        assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, show(done)

    (root / "data.txt").write_text("two\n")
    again = doit(root)
    assert again.returncode == 0, show(again)
    assert [len(runs_of(root, step)) for step in "abc"] == [2, 2, 2]


def test_a_damaged_cost_record_of_a_running_step_never_lets_it_spend_past_its_cap(tmp_path: Path) -> None:
    """Its machine lost while its price in the record is damaged: what its
    attempts spent is not known, so it is not relaunched past its cap
    (before: it was, with no cap at all, and finished)."""
    body = "def task_all():\n" + count_step("count", 200, 0.05, preemptions=2)
    root = make_project(tmp_path, body, files={"count.py": COUNT_PY, "data.txt": "one\n"})
    write_pyproject(root, extra=PRICED)
    proc = popen_doit(root, "count")
    try:
        def running() -> dict[str, Any] | None:
            """The run's status, once its handle and its status are written."""
            for status in (root / ".substrax" / "runs").glob("*/status.json"):
                with contextlib.suppress(OSError, ValueError):
                    found: dict[str, Any] = json.loads(status.read_text())
                    return found
            return None

        wait_for(lambda: (running() or {}).get("state") == "running", "the command to run")
        (run,) = runs_of(root, "count")
        damage_machine(root, run["run_id"], lambda m: {**m, "hourly_cost": "3.6"})
        worker = (running() or {})["worker_pid"]
        os.kill(worker, signal.SIGKILL)  # its machine is lost, as a preempted one
        code = wait_exit(proc, "the doit to end", 120)
    finally:
        stop(proc)
    said = popen_output(root)
    assert code == 1 and "Traceback" not in said, said
    assert "hourly_cost = '3.6', not a number of USD" in said, said
    # Not relaunched: the driver reads the record as it is when the run is
    # lost (before: the one it held, from before the damage, and a paid
    # relaunch went out, stopped at once by its worker).
    assert "max_cost = $5.0000 is not known" in said, said
    assert "relaunching it" not in said, said
    (handle,) = runs_of(root, "count")
    assert "succeeded" not in [a["outcome"] for a in handle["state"]["attempts"]], handle["state"]["attempts"]
    assert not (root / "count.txt").exists()
