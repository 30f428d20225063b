"""What the two halves of one set of tests share: the integration tests
(tests/integration/skypilot/test_skypilot_config.py)
and the unit tests (tests/unit/test_skypilot_config_unit.py)."""

from __future__ import annotations

from pathlib import Path

TABLE = "[tool.substrax.compute.backends.skypilot]"


COPY = "[tool.substrax.compute.backends.skypilot.copy]"


def write(root: Path, tables: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text('[tool.substrax.compute]\ndefault_backend = "skypilot"\n' + tables)
    return root
