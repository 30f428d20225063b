"""Operating a sweep with `substrax-compute`: `status` shows the latest run
of each step (`--all` every run, `--step` or a word filters), `logs` and
`cancel` take a step or a group (`fit` of `fit:a`, `fit:b`, ...), and the
project is found from a subfolder. Real doit runs of sweeps on the local
backend; the CLI run as its own process."""

from __future__ import annotations

import functools
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import (
    COMPUTE,
    clean_env,
    compute,
    compute_status,
    doit,
    doit_ok,
    make_project,
    pids_with,
    popen_doit,
    popen_output,
    runs_of,
    show,
    status_records,
    stop,
    stop_marked,
    wait_for,
    worker_pids,
)
from local_runs import WAIT, submit, wait_final

from substrax_tasks.backends.base import Backend
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project

MEMBERS = ["a", "b", "c", "d"]
# Each member's log says which take it is (`doit fit:b take=2` makes a new
# run of fit:b alone: its command changed).
SWEEP = """
TAKE = get_var("take", "1")

def task_fit():
    for m in {members!r}:
        yield from remote_step(
            f"fit:{{m}}",
            command=["/bin/sh", "-c", 'echo "log of $1 take $2"; echo "$1" > "fit-$1.txt"', "fit", m, TAKE],
            outputs=[f"fit-{{m}}.txt"],
        )

def task_solo():
    yield from remote_step("solo", shell="echo solo > solo.txt", outputs=["solo.txt"])
"""


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep run with threads, then one member run again: fit:b has two
    runs, every other step one. The tests run nothing more in it."""
    root = make_project(tmp_path_factory.mktemp("sweep"), SWEEP.format(members=MEMBERS))
    doit_ok(root, "-n", "4", "-P", "thread", "fit", "solo")
    doit_ok(root, "fit:b", "take=2")
    return root


def status_json(root: Path, *args: str) -> list[dict[str, Any]]:
    done = compute(root, "status", "--json", *args)
    assert done.returncode == 0, show(done)
    runs: list[dict[str, Any]] = json.loads(done.stdout)["runs"]
    return runs


def run_ids(runs: list[dict[str, Any]], step: str) -> list[str]:
    return [r["run_id"] for r in runs if r["step"] == step]


# ------------------------------------------------------------------ status


def test_status_shows_the_latest_run_of_each_step_and_every_run_with_all(swept: Path) -> None:
    every = compute_status(swept)  # --all
    old_b, new_b = run_ids(every, "fit:b")
    latest = status_json(swept)
    assert sorted(r["step"] for r in latest) == ["fit:a", "fit:b", "fit:c", "fit:d", "solo"]
    assert run_ids(latest, "fit:b") == [new_b]
    assert all(r["latest"] for r in latest)
    assert {r["step"]: r["group"] for r in latest}["solo"] is None
    assert {r["group"] for r in latest if r["step"] != "solo"} == {"fit"}
    # the keys scripts read are all still there
    keys = ["run_id", "step", "backend", "state", "created_at", "started_at", "ended_at", "exit_code"]
    assert all(set(keys) | {"message"} <= set(r) for r in latest)
    assert len(every) == 6
    assert [r["latest"] for r in every if r["step"] == "fit:b"] == [False, True]
    table = compute(swept, "status")
    assert table.returncode == 0, show(table)
    assert new_b in table.stdout and old_b not in table.stdout
    assert "1 older run(s) not shown; --all lists every run" in table.stderr
    everything = compute(swept, "status", "--all")
    assert old_b in everything.stdout and "not shown" not in everything.stderr


def test_status_filters_by_step_or_group(swept: Path) -> None:
    group = status_json(swept, "--step", "fit")
    assert sorted(r["step"] for r in group) == [f"fit:{m}" for m in MEMBERS]
    assert len(status_json(swept, "--step", "fit", "--all")) == 5
    assert [r["step"] for r in status_json(swept, "--step", "solo")] == ["solo"]
    # the word given as RUN does the same, and an older run by its id is shown
    assert len(status_json(swept, "fit:b")) == 1
    old_b, _ = run_ids(status_json(swept, "fit:b", "--all"), "fit:b")
    assert [r["run_id"] for r in status_json(swept, old_b)] == [old_b]
    assert status_json(swept, old_b)[0]["latest"] is False


def test_status_filter_errors(swept: Path) -> None:
    unknown = compute(swept, "status", "--step", "fti")
    assert unknown.returncode == 1, show(unknown)
    assert "no runs of a step or group named 'fti'" in unknown.stderr
    assert "steps with runs: fit:a, fit:b, fit:c, fit:d, solo; groups: fit" in unknown.stderr
    both = compute(swept, "status", "fit", "--step", "fit")
    assert both.returncode == 2, show(both)
    assert "give RUN or --step NAME, not both" in both.stderr
    ambiguous = compute(swept, "status", "fit-b")  # a prefix of both runs of fit:b
    assert ambiguous.returncode == 1, show(ambiguous)
    assert "matches several runs" in ambiguous.stderr
    assert all(run_id in ambiguous.stderr for run_id in run_ids(compute_status(swept), "fit:b"))


def test_status_and_why_from_a_subfolder_find_the_project(swept: Path) -> None:
    deep = swept / "notes" / "deeper"
    deep.mkdir(parents=True, exist_ok=True)
    # a folder's own pyproject.toml without [tool.substrax] is passed over
    (swept / "notes" / "pyproject.toml").write_text('[project]\nname = "notes"\n')

    def here(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(COMPUTE), *args], cwd=deep, env=clean_env(), capture_output=True, text=True,
            timeout=WAIT, check=False,
        )  # fmt: skip

    status = here("status", "--json")
    assert status.returncode == 0, show(status)
    assert sorted(r["step"] for r in json.loads(status.stdout)["runs"]) == [
        "fit:a", "fit:b", "fit:c", "fit:d", "solo"
    ]  # fmt: skip
    why = here("why", "fit:a")  # loads dodo.py of the project found
    assert why.returncode == 0 and why.stdout.strip() == "fit:a: up to date", show(why)


# -------------------------------------------------------------------- logs


def test_logs_of_a_step_prints_its_latest_run(swept: Path) -> None:
    done = compute(swept, "logs", "fit:b")
    assert done.returncode == 0, show(done)
    assert "log of b take 2" in done.stdout and "take 1" not in done.stdout
    old_b, _ = run_ids(compute_status(swept), "fit:b")
    assert "log of b take 1" in compute(swept, "logs", old_b).stdout  # run ids still work


def test_logs_of_a_group_prints_each_members_latest_log_under_a_header(swept: Path) -> None:
    done = compute(swept, "logs", "fit")
    assert done.returncode == 0, show(done)
    latest = {r["step"]: r["run_id"] for r in status_json(swept, "--step", "fit")}
    sections = done.stdout.split("==> ")[1:]
    assert sorted(s.split("\n", 1)[0] for s in sections) == sorted(
        f"{step} ({run_id}) <==" for step, run_id in latest.items()
    )
    for section in sections:
        step = section.split(" ", 1)[0]
        take = "2" if step == "fit:b" else "1"
        assert f"log of {step[len('fit:'):]} take {take}\n" in section, done.stdout
    follow = compute(swept, "logs", "--follow", "fit")
    assert follow.returncode == 1, show(follow)
    assert "fit is a group of 4 steps (fit:a, fit:b, fit:c, fit:d)" in follow.stderr
    assert "substrax-compute logs --follow fit:" in follow.stderr


# ------------------------------------------------------------------ cancel

# Members that wait for gate/go, each tree marked "$0" = MARKER-member so the
# test finds it in /proc; "quick" does not wait.
GATED = """
MARKER = {marker!r}

def task_gated():
    for m in ["a", "b", "c", "quick"]:
        wait = "" if m == "quick" else "while [ ! -e gate/go ]; do sleep 0.05; done; "
        yield from remote_step(
            f"gated:{{m}}",
            command=["/bin/sh", "-c", wait + 'echo "$1" > "gated-$1.txt"', f"{{MARKER}}-{{m}}", m],
            inputs=["gate/"],
            outputs=[f"gated-{{m}}.txt"],
        )
"""


@pytest.fixture
def marker() -> Iterator[str]:
    value = f"substrax-sweep-test-{uuid.uuid4().hex}"
    yield value
    stop_marked(value)


def test_cancel_of_a_group_stops_the_latest_run_of_every_member_still_going(
    tmp_path: Path, marker: str
) -> None:
    root = make_project(tmp_path, GATED.format(marker=marker))
    (root / "gate").mkdir()
    proc = popen_doit(root, "-n", "4", "-P", "thread", "gated")
    try:
        going = [*["running"] * 3, "succeeded"]
        wait_for(
            lambda: sorted(str(r.get("state")) for r in status_records(root)) == going,
            "three gated members running and quick done",
        )
        for m in ("a", "b", "c"):
            assert pids_with(f"{marker}-{m}"), f"gated:{m} is not running"
        done = compute(root, "cancel", "gated")
        assert proc.wait(timeout=WAIT) == 1, popen_output(root)  # its steps were cancelled
    finally:
        stop(proc)
    assert done.returncode == 0, show(done)
    assert "gated: cancelling the latest run of each of its 4 steps" in done.stdout
    runs = {r["step"]: r for r in compute_status(root)}
    for m in ("a", "b", "c"):
        assert f"run {runs[f'gated:{m}']['run_id']}: cancelled" in done.stdout, show(done)
        assert runs[f"gated:{m}"]["state"] == "cancelled"
        assert not pids_with(f"{marker}-{m}"), f"gated:{m}'s tree outlived the cancel"
    quick = runs["gated:quick"]["run_id"]
    assert f"run {quick} had already finished (succeeded); nothing to cancel" in done.stdout
    assert not worker_pids(root)
    assert (root / "gated-quick.txt").read_text() == "quick\n"  # a finished member keeps its outputs
    assert not (root / "gated-a.txt").exists()
    again = doit(root, "gated:quick")
    assert again.returncode == 0, show(again)
    assert len(runs_of(root, "gated:quick")) == 1  # it stays done: not run again


def running(backend: Backend, handle: RunHandle) -> bool:
    return backend.poll(handle).state == "running"


def test_cancel_of_a_group_attempts_every_member_and_reports_the_failures_together(
    project: Project, marker: str
) -> None:
    forever = "while :; do sleep 1; done"
    runs = {m: submit(project, ["sh", "-c", forever, f"{marker}-{m}"], step=f"grp:{m}") for m in "abc"}
    backend = project.backend_for(runs["a"])
    for handle in runs.values():
        wait_for(functools.partial(running, backend, handle), f"{handle.step} to start")
    # grp:b was made by a release whose settings this one cannot use
    path = project.store.handle_path(runs["b"].run_id)
    data = json.loads(path.read_text())
    data["settings"]["sandbox"] = "firejail"
    path.write_text(json.dumps(data))
    done = compute(project.root, "cancel", "grp")
    assert done.returncode == 1, show(done)
    assert "1 of 3 runs of grp were not cancelled" in done.stderr
    assert f"grp:b ({runs['b'].run_id}): run {runs['b'].run_id}: its pinned local settings" in done.stderr
    for m in "ac":
        assert f"run {runs[m].run_id}: cancelled" in done.stdout, show(done)
        assert wait_final(project, runs[m]) == "cancelled"
        assert not pids_with(f"{marker}-{m}")
    assert pids_with(f"{marker}-b")  # not reached, still going: the test's teardown stops it
    step = compute(project.root, "cancel", "grp:a")
    assert step.returncode == 0, show(step)
    assert f"run {runs['a'].run_id} had already finished (cancelled); nothing to cancel" in step.stdout
