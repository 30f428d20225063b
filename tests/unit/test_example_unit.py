"""The unit half of tests/integration/chain/test_example.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
from dodo_helpers import REPO
from example_parts import (
    example,  # noqa: F401 - fixtures
    )


@pytest.mark.unit
def test_loading_the_example_declares_its_tasks_and_runs_nothing(example: Path) -> None:
    """What doit does first: load dodo.py and call its task functions. That
    starts no process (the unit guard would fail it) and writes nothing."""
    before = sorted(p.name for p in example.iterdir())
    dodo = runpy.run_path(str(example / "dodo.py"))
    assert dodo["DOIT_CONFIG"]["default_tasks"] == ["report"]
    (fit,) = [task for task in dodo["task_fit"]() if task.get("basename") == "fit"]
    # downstream steps reach the remote step's outputs through plain file_dep
    assert fit["targets"] == dodo["MODEL"]
    assert set(dodo["task_report"]()["file_dep"]) >= set(fit["targets"])
    assert sorted(p.name for p in example.iterdir()) == before


@pytest.mark.unit
def test_make_remote_run_starts_its_throwaway_host_with_a_script_that_exists() -> None:
    """`make remote-run` without a configured remote runs the ssh test bed's
    script by its path (it was left behind when tests/ moved: `can't open file`)."""
    text = (REPO / "scripts" / "remote_run.sh").read_text()
    (script,) = re.findall(r"^TESTBED=(\S+)$", text, re.MULTILINE)
    assert (REPO / script).is_file(), script
