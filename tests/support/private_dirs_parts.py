"""What the two halves of one set of tests share: the integration tests
(tests/integration/config/test_private_dirs.py) and the unit tests (tests/unit/test_private_dirs_unit.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = os.geteuid() == 0


needs_root_to_chown = pytest.mark.skipif(not ROOT, reason="FOREIGN-OWNED FOLDER NOT TESTED: chown needs root")


OTHER_UID = 65534  # nobody


UID = os.getuid()


def plant(base: Path, name: str, how: str) -> Path:
    """What another user could leave at base/name before we come."""
    folder = base / name
    if how == "symlink":
        target = base / "elsewhere"
        target.mkdir(mode=0o700)
        folder.symlink_to(target)
    elif how == "file":
        folder.write_text("")
    else:
        folder.mkdir()
        if how == "foreign":
            os.chown(folder, OTHER_UID, OTHER_UID)
            folder.chmod(0o700)
        else:  # "world-writable"
            folder.chmod(0o777)
    return folder


PLANTED = [
    pytest.param("foreign", f"belongs to uid {OTHER_UID}, not to you", id="foreign-owned",
                 marks=needs_root_to_chown),
    pytest.param("world-writable", "is writable by others (mode 0777)", id="world-writable"),
    pytest.param("symlink", "is a symlink", id="symlink"),
    pytest.param("file", "is not a folder", id="file"),
]  # fmt: skip
