"""What the two halves of one set of tests share: the integration tests
(tests/integration/chain/test_view.py) and the unit tests (tests/unit/test_view_unit.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dodo_helpers import DEFAULT_SANDBOX, make_project, write_pyproject

WORK = (
    'import os, helper\nos.makedirs("out", exist_ok=True)\n'
    'open("out/result.txt", "w").write(helper.VALUE)\n'
)


def work_step(inputs: list[str]) -> str:
    return f"""
def task_work():
    yield from remote_step("work", command=["python3", "work.py"], inputs={inputs!r},
                           outputs=["out/result.txt"])
"""


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, timeout=60)


def clone(tmp_path: Path, name: str, value: str, inputs: list[str], sandbox: str = DEFAULT_SANDBOX) -> Path:
    """The issue's project: work.py imports helper.py; every file tracked by
    git; the run cache on, in the one $XDG_CACHE_HOME of the test."""
    (tmp_path / name).mkdir()
    files = {"work.py": WORK, "helper.py": f'VALUE = "{value}"\n', "README.md": "a pipeline\n",
             ".gitignore": ".substrax/\n.doit.db*\n"}  # fmt: skip
    root = make_project(tmp_path / name, work_step(inputs), ["work"], sandbox=sandbox, files=files)
    write_pyproject(root, sandbox, cache="")  # the cache as shipped: on, in $XDG_CACHE_HOME
    git(root, "init", "-q")
    git(root, "add", "-A")
    return root
