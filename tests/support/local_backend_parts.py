"""What the two halves of one set of tests share: the integration tests
(tests/integration/local/test_local_backend.py) and the unit tests (tests/unit/test_local_backend_unit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def path_without_bwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PATH on which bubblewrap cannot be found (commands use absolute paths)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
