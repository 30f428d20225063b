"""The repository's own example pipeline (dodo.py + scripts/), as `make demo`
and `make remote-run` run it: in a copy of the repository's files, with the
real `make` and `doit` (the virtualenv is this one, so make installs nothing)."""

from __future__ import annotations

import json
from pathlib import Path

from dodo_helpers import doit_ok, handles, run_count, show, step_ran, step_skipped
from example_parts import (
    example,  # noqa: F401 - fixtures
    make,
)

TASKS = ("data", "fit", "report")


def test_make_demo_runs_three_steps_then_nothing(example: Path) -> None:
    first = make(example, "demo")
    for task in TASKS:
        assert step_ran(first, task), show(first)
    assert run_count(example) == 1  # one remote step: fit
    (run,) = handles(example)
    assert run["step"] == "fit"
    assert run["state"]["phase"] == "promoted"
    coef = json.loads((example / "demo-data" / "model" / "coef.json").read_text())
    assert abs(coef["slope"] - 3) < 0.1 and abs(coef["intercept"] - 2) < 0.1
    report = (example / "demo-data" / "report.md").read_text()
    assert "# Fit report" in report and "points: 2000" in report

    second = make(example, "demo")
    for task in TASKS:
        assert step_skipped(second, task), show(second)
    assert not any(line.startswith(".  ") for line in second.stdout.splitlines()), show(second)
    assert "nothing to do" in second.stdout  # and says so
    assert run_count(example) == 1


def test_demo_reruns_only_what_a_change_reaches(example: Path) -> None:
    doit_ok(example)
    script = example / "scripts" / "report.py"
    script.write_text(script.read_text() + "\n# a comment\n")
    again = doit_ok(example)
    assert step_ran(again, "report"), show(again)
    assert step_skipped(again, "fit") and step_skipped(again, "data"), show(again)
    assert run_count(example) == 1
    fit = example / "scripts" / "fit.py"
    fit.write_text(fit.read_text() + "\n# a comment\n")
    third = doit_ok(example)
    assert step_ran(third, "fit"), show(third)
    assert run_count(example) == 2
    # fit's outputs are byte for byte the same: report's file_dep did not change
    assert step_skipped(third, "report"), show(third)


def test_example_lists_its_public_tasks_only(example: Path) -> None:
    listed = doit_ok(example, "list")
    names = sorted(line.split()[0] for line in listed.stdout.splitlines() if line.strip())
    assert set(TASKS) <= set(names), show(listed)
    assert not any(name.startswith("_") for name in names)


def test_make_remote_run_runs_the_remote_step(example: Path) -> None:
    done = make(example, "remote-run", env={"SUBSTRAX_BACKEND": "local"})
    assert step_ran(done, "fit"), show(done)
    assert not step_ran(done, "report"), show(done)  # the remote step alone
    assert [h["step"] for h in handles(example)] == ["fit"]


def test_make_remote_run_runs_the_step_whatever_the_cache_holds(example: Path) -> None:
    """After `make demo` kept fit in the run cache, `make remote-run` runs it
    for real (here on the configured backend, local: the throwaway ssh host
    sets the same SUBSTRAX_CACHE=off) and says so, instead of restoring it."""
    make(example, "demo")
    doit_ok(example, "forget", "fit")  # fit must run again: the cache holds its outputs
    done = make(example, "remote-run", env={"SUBSTRAX_BACKEND": "local"})
    assert step_ran(done, "fit") and "restored from cache" not in done.stdout, show(done)
    assert "the run cache is off for this run (SUBSTRAX_CACHE=off)" in done.stdout, show(done)
    assert run_count(example) == 2
