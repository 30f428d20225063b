"""What the two halves of one set of tests share: the integration tests
(tests/integration/chain/test_proofs.py) and the unit tests (tests/unit/test_proofs_unit.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from dodo_helpers import RACY_SECONDS, doit_ok, make_project, step_ran, step_skipped

FILE_NAME = "up-to-date.json"


BODY = """
def task_step():
    yield from remote_step(
        "step",
        command=["/bin/sh", "-c", "mkdir -p out && cp data/in.txt out/a.txt && cp data/dir/x out/x"],
        inputs=["data/in.txt", "data/dir"],
        outputs=["out/"],
    )
"""


def wait_out_racy_window() -> None:
    time.sleep(float(RACY_SECONDS) + 0.1)


def proven(root: Path) -> dict[str, str]:
    path = root / ".substrax" / "cache" / FILE_NAME
    data: dict[str, dict[str, str]] = json.loads(path.read_text())
    return data["proofs"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A step that ran, then a no-op that recorded its proof."""
    project = make_project(tmp_path, BODY, ["step"], files={"data/in.txt": "in\n", "data/dir/x": "x\n"})
    assert step_ran(doit_ok(project), "step")
    wait_out_racy_window()
    assert step_skipped(doit_ok(project), "step")
    assert set(proven(project)) == {"step"}
    return project
