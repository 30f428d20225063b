"""The Python a step's command names is part of its key (docs/cache.md):
without a lock file, another Python first on PATH is another key, through
the real `doit`, `why` and a cache folder shared by the doits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cache_parts import folder_cache, restored
from dodo_helpers import (
    compute,
    doit_ok,
    make_project,
    run_count,
    show,
    step_ran,
    step_skipped,
    write_pyproject,
)

PYENV = Path("/root/.pyenv/versions")
OLD, NEW = "3.10.13", "3.12.1"

# The command's argv names `python3`: which one is what PATH finds.
BODY = """
def task_make():
    yield from remote_step("make", command=["python3", "report.py"], inputs=["report.py"],
                           outputs=["out/py.txt"])
"""
REPORT = "import os, sys\nos.makedirs('out', exist_ok=True)\nopen('out/py.txt', 'w').write(sys.version)\n"


def first_on_path(version: str) -> dict[str, str]:
    """The environment of a doit with pyenv's `version` first on PATH."""
    folder = PYENV / version / "bin"
    if not (folder / "python3").is_file():
        pytest.skip(f"LOUD SKIP: Python {version} is not at {folder} (the machine image's pyenv builds)")
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def test_another_python_first_on_path_runs_again_and_why_names_it(tmp_path: Path) -> None:
    old, new = first_on_path(OLD), first_on_path(NEW)
    root = make_project(tmp_path, BODY, default_tasks=["make"], files={"report.py": REPORT})
    write_pyproject(root, cache="[tool.substrax.compute.cache]\n" + folder_cache(tmp_path))
    done = doit_ok(root, env=old)
    assert step_ran(done, "make") and (root / "out/py.txt").read_text().startswith(OLD), show(done)
    assert step_skipped(doit_ok(root, env=old), "make")  # the no-op: its proof holds the Python found

    why = compute(root, "why", "make", env=new)
    said = [line for line in why.stdout.splitlines() if "interpreter changed" in line]
    assert len(said) == 1 and f"{PYENV / OLD}" in said[0] and f"({OLD})" in said[0], show(why)
    assert f"{PYENV / NEW}" in said[0] and f"({NEW})" in said[0], said
    assert "would be restored" not in why.stdout, show(why)
    done = doit_ok(root, env=new)
    assert not restored(done) and step_ran(done, "make") and run_count(root) == 2, show(done)
    assert (root / "out/py.txt").read_text().startswith(NEW)
    assert step_skipped(doit_ok(root, env=new), "make")

    # back to the first Python: its own entry, restored, never the other's
    done = doit_ok(root, env=old)
    assert restored(done) and run_count(root) == 2, show(done)
    assert (root / "out/py.txt").read_text().startswith(OLD)
