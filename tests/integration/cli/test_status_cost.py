"""`substrax-compute status` on a terminal, as a person reads it: each run's
duration and cost against its cap, and a sweep's total against the sum of
its members' caps (tmux; the figures checked against `status --json`)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from dodo_helpers import COMPUTE, compute, doit, make_project, show, wait_for, write_pyproject
from terminal import Terminal, needs_tmux

# A cent a second on this machine; `fit:c` runs into its cap of 5 cents.
SWEEP = """
def task_fit():
    for m in "ab":
        yield from remote_step(f"fit:{m}", shell=f"sleep 1; echo {m} > fit-{m}.txt", outputs=[f"fit-{m}.txt"],
                               max_cost=0.5)
    yield from remote_step("fit:c", shell="echo going; sleep 60; echo c > fit-c.txt", outputs=["fit-c.txt"],
                           max_cost=0.05)
"""


@needs_tmux
def test_status_shows_each_runs_cost_and_the_groups_total_against_its_caps(tmp_path: Path) -> None:
    root = make_project(tmp_path, SWEEP, default_tasks=["fit"])
    write_pyproject(root, extra="hourly_cost = 36.0\n")
    done = doit(root, "-n", "3", "-P", "thread", timeout=120)
    assert done.returncode == 1, show(done)
    assert "its cost reached max_cost = $0.0500" in done.stdout + done.stderr, show(done)
    listed = compute(root, "status", "--json")
    assert listed.returncode == 0, show(listed)
    data = json.loads(listed.stdout)
    runs = {r["step"]: r for r in data["runs"]}
    assert runs["fit:a"]["state"] == runs["fit:b"]["state"] == "succeeded"
    assert runs["fit:c"]["state"] == "failed" and "max_cost" in runs["fit:c"]["message"]
    total = sum(r["cost_usd"] for r in runs.values())
    assert data["groups"] == [{"group": "fit", "runs": 3, "cost_usd": pytest.approx(total), "max_cost": 1.05}]
    term = Terminal(root, "status")
    try:
        term.type(f"{shlex.quote(str(COMPUTE))} status; echo status-ended-$((0 + $?))")
        wait_for(lambda: re.search(r"status-ended-\d", term.screen()), "status to end in the terminal")
        screen = term.screen()
    finally:
        term.close()
    assert "status-ended-0" in screen, screen
    lines = screen.splitlines()
    header = next(line for line in lines if line.startswith("run "))
    assert header.split() == ["run", "step", "backend", "state", "started", "duration", "cost"], screen
    for step, run in runs.items():
        row = next(line for line in lines if line.startswith(run["run_id"]))
        cap = "$0.5000" if step != "fit:c" else "$0.0500"
        cells = row.split()
        assert cells[3] == run["state"] and cells[-1] == f"${run['cost_usd']:.4f}/{cap}", screen
    said = f"group fit: ${total:.4f} over 3 run(s) of max_cost $1.0500 (the sum of their caps)"
    assert said in screen, screen
