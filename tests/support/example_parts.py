"""What the two halves of one set of tests share: the integration tests
(tests/integration/chain/test_example.py) and the unit tests (tests/unit/test_example_unit.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from dodo_helpers import BIN, REPO, clean_env, show


@pytest.fixture
def example(tmp_path: Path) -> Path:
    """A fresh copy of what `make demo` needs: Makefile, dodo.py, scripts/, pyproject.toml."""
    root = tmp_path / "example"
    root.mkdir()
    for name in ("Makefile", "dodo.py", "pyproject.toml"):
        shutil.copy2(REPO / name, root / name)
    shutil.copytree(REPO / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def make(root: Path, target: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`make TARGET` in the copy, with this virtualenv taken as installed."""
    done = subprocess.run(
        ["make", "-o", "install", "-o", "demo-deps", f"VENV={BIN.parent}", target],
        cwd=root, env=clean_env(env), capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, show(done)
    return done
