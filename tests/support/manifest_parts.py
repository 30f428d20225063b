"""What the two halves of one set of tests share: the integration tests
(tests/integration/manifests/test_manifest.py) and the unit tests (tests/unit/test_manifest_unit.py)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from substrax_tasks._remote import manifest as remote_manifest

OLD_NS = 1_600_000_000 * 10**9  # a moment long past: files older than the racy window


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(path: Path, data: bytes, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.fixture(autouse=True)
def short_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A racy window of 50 ms, here and in the scripts these tests start:
    a ctime cannot be set into the past, so a test waits the window out
    (`age`) instead of 2 s. Tests of the racy rule itself set their own."""
    monkeypatch.setattr(remote_manifest, "RACY_SECONDS", 0.05)
    monkeypatch.setenv("SUBSTRAX_RACY_SECONDS", "0.05")


def age(root: Path) -> None:
    """Set every mtime under `root` into the past (links are left alone),
    and wait out the racy window for their ctimes."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.utime(p, ns=(OLD_NS, OLD_NS))
    time.sleep(0.06)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """out/ with files, a sub folder, an empty folder and in-tree links;
    report.txt a file output; data/ outside the outputs."""
    p = tmp_path / "proj"
    write(p / "out/a.txt", b"alpha\n")
    write(p / "out/run.sh", b"#!/bin/sh\n", 0o755)
    write(p / "out/sub/b.bin", bytes(range(256)) * 10, 0o600)
    (p / "out/empty").mkdir()
    (p / "out/sub").chmod(0o750)
    os.symlink("a.txt", p / "out/link_to_file")
    os.symlink("sub", p / "out/link_to_dir")
    os.symlink("../a.txt", p / "out/sub/up_one")
    os.symlink("not-yet", p / "out/dangling")
    write(p / "report.txt", b"report\n")
    write(p / "data/input.csv", b"1,2\n")
    return p


def record(stat_values: Sequence[int], digest: str) -> bytes:
    """A hash cache's record of a file whose size, mtime_ns, ctime_ns,
    inode and device are `stat_values`, with that sha256."""
    return remote_manifest.cache_record(remote_manifest.stat_key_of(*stat_values), digest)
