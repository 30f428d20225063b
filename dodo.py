"""The example pipeline: make data here -> fit remotely -> report here.

    make demo            # or: .venv/bin/doit
    .venv/bin/doit fit   # the remote step alone
    SUBSTRAX_BACKEND=ssh .venv/bin/doit fit

`fit` runs through remote_step() on the configured backend (the local one,
in the sandbox, by default); the other two are ordinary doit tasks that
depend on its outputs with plain file_dep.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from substrax_tasks import doit_config, remote_step

DOIT_CONFIG = doit_config(default_tasks=["report"])
PYTHON = "python3"  # found on PATH, here and on the remote machine
DATA = "demo-data/points.csv"
MODEL = ["demo-data/model/coef.json", "demo-data/model/metrics.json"]


def task_data() -> dict[str, Any]:
    """Make the data set (here)."""
    return {
        "actions": [[PYTHON, "scripts/make_data.py", DATA]],
        "file_dep": ["scripts/make_data.py"],
        "targets": [DATA],
        "clean": True,
    }


def task_fit() -> Iterator[dict[str, Any]]:
    """Fit the model (on the backend)."""
    yield from remote_step(
        "fit",
        command=[PYTHON, "scripts/fit.py", DATA, "demo-data/model"],
        inputs=[DATA, "scripts/fit.py"],
        outputs=MODEL,
        timeout=600,
        doc="fit the model on the configured backend",
        clean=True,
    )


def task_report() -> dict[str, Any]:
    """Write the report (here)."""
    return {
        "actions": [[PYTHON, "scripts/report.py", *MODEL, "demo-data/report.md"]],
        "file_dep": ["scripts/report.py", *MODEL],
        "targets": ["demo-data/report.md"],
        "clean": True,
    }
